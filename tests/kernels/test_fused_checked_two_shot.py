"""The other half of test_fused_checked.py: every module the checked table claims for the
one-launch two-shot at P = 4 and above is the one this checkout emits (lowered for CUDA on
CPU)."""
import jax
import pytest

from taco_jax.kernels.fused import checked


@pytest.mark.skipif(jax.__version__ != checked.JAX,
                    reason=f"the table's fingerprints are jax {checked.JAX}'s lowering")
def test_every_two_shot_module_from_p4_the_table_claims_is_the_one_emitted_now():
    table = {t: tuple((p, fp) for p, fp in pairs if p >= 4)
             for t, pairs in checked.CHECKED.items() if t[0] == "two_shot"}
    lines = checked.stale({t: pairs for t, pairs in table.items() if pairs})
    assert not lines, "the checked table claims modules this checkout no longer emits:\n" + \
        "\n".join(lines)
