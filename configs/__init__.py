"""Training presets (tiny, small, 350m, comm_heavy) as package data: `python -m train
--config NAME` finds them with importlib.resources, in a checkout or an installed wheel."""
