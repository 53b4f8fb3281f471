"""Training presets (tiny, small, 350m, comm_heavy, fidelity) as YAML files: `python -m train
--config NAME` finds them beside train/ in the checkout (train.config.PRESET_DIR)."""
