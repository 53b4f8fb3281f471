"""Where the axis is not bound, a taco_jax collective raises jax's own NameError message
(what the lax collective of the same name says, called the same way), whole, and after it
which taco_jax op and where to call it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taco_jax


def _message(fn):
    with pytest.raises(NameError) as e:
        fn()
    return str(e.value)


CONTEXTS = {
    "eager": lambda f, x: f(x),
    "jit": lambda f, x: jax.jit(f)(x),
    "make_jaxpr": lambda f, x: jax.make_jaxpr(f)(x),
}

OPS = {   # taco_jax op → the lax collective of the same name, called the same way
    "psum": (lambda v: taco_jax.psum(v, "x", codec="none"), lambda v: lax.psum(v, "x")),
    "psum tuple": (lambda v: taco_jax.psum(v, ("x", "y")), lambda v: lax.psum(v, ("x", "y"))),
    "all_gather": (lambda v: taco_jax.all_gather(v, "x"), lambda v: lax.all_gather(v, "x")),
    "psum_scatter": (lambda v: taco_jax.psum_scatter(v, "x", tiled=True),
                     lambda v: lax.psum_scatter(v, "x", tiled=True)),
    "ppermute": (lambda v: taco_jax.ppermute(v, "x", [(0, 0)]),
                 lambda v: lax.ppermute(v, "x", [(0, 0)])),
}


@pytest.mark.parametrize("context", sorted(CONTEXTS))
@pytest.mark.parametrize("op", sorted(OPS))
def test_unbound_axis_keeps_jax_message(op, context):
    if (op, context) == ("ppermute", "eager"):
        pytest.skip("lax.ppermute has no eager rule: no NameError of jax's to keep")
    ours, theirs = OPS[op]
    call = CONTEXTS[context]
    x = jnp.asarray(np.arange(8, dtype=np.float32))
    expected = _message(lambda: call(theirs, x))
    got = _message(lambda: call(ours, x))
    name = op.split()[0]
    assert expected in got, (got, expected)
    assert f"taco_jax.{name}: axis_name='x'" in got[got.index(expected) + len(expected):], got


def test_unbound_axis_error_is_a_name_error():
    with pytest.raises(taco_jax.UnboundAxisError):
        jax.jit(lambda v: taco_jax.psum(v, "x"))(jnp.ones(4))
    assert issubclass(taco_jax.UnboundAxisError, NameError)
