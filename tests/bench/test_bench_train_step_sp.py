"""bench.train_step's fair baseline of the overlap rows: the serial sequence-parallel step."""
from bench import train_step


def test_sp_runs_before_the_first_overlap_row_unless_named():
    add = train_step.with_sp_baseline
    assert add(["none", "taco:xla", "none:overlap", "taco:overlap"]) == [
        "none", "taco:xla", "sp", "none:overlap", "taco:overlap"]
    assert add(["none", "none:overlap", "sp"]) == ["none", "none:overlap", "sp"]
    assert add(["none", "taco:xla"]) == ["none", "taco:xla"]        # no overlap: no sp
