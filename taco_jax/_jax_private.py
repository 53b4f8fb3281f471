"""Every use of jax's private API in taco_jax, in this one module.

jax offers no public way to do what these functions do. Each was checked on the jax
versions in CHECKED; on another version a function that finds jax's internals changed
raises `JaxInternalsError` naming the installed version and the checked ones, instead of
failing somewhere deep in a trace.
"""
from __future__ import annotations

import jax

CHECKED = ("0.11.2", "0.12.0")


class JaxInternalsError(RuntimeError):
    """A private jax API that taco_jax relies on is missing or changed in this jax."""


def _broken(what: str, err: Exception) -> JaxInternalsError:
    return JaxInternalsError(
        f"taco_jax needs jax's private {what}, which jax {jax.__version__} does not provide "
        f"as taco_jax expects ({type(err).__name__}: {err}); taco_jax was checked on jax "
        f"{', '.join(CHECKED)}")


def extend_axis_env(axis_name, size: int):
    """A context that binds `axis_name` with `size` for the code traced inside, as
    `jax.vmap(..., axis_name=...)` does. A custom_vjp backward rule under vmap is traced
    after the vmap's axis is unbound; its collectives need the axis bound again."""
    try:
        from jax._src import core
        return core.extend_axis_env_nd([(axis_name, size)])
    except (ImportError, AttributeError, TypeError) as e:
        raise _broken("jax._src.core.extend_axis_env_nd", e) from None
