"""An independent numpy implementation of the TACO codec (paper §4, Algorithm 1, eqs. 6–13).

Written from the paper and the wire-format spec only: it imports nothing from `taco_jax`,
builds the Hadamard matrix by Kronecker products, rounds onto the FP8 grids by arithmetic
(no ml_dtypes) and decodes FP8 bit patterns by hand. Everything is computed in float64, so
where it disagrees with the float32 library it is either a rounding tie or a library bug.

Wire format (one row per block of B elements): B code bytes, then the fp32 scales
little-endian: s (eq. 9), then α (eq. 7) for the dual-scale ("taco*") codecs. Codes are
the normalised Hadamard coefficients in *wire order*: stored[j·r + m] = (H_B x/√B)[m·c + j]
with (r, c) = (2^⌊log2(B)/2⌋, B/r), i.e. Zᵀ of Z = H_r X H_c/√B for the block viewed r×c.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

TAU, EPS, ALPHA_MIN, ALPHA_MAX = 448.0, 1e-6, 1e-3, 1e3      # eqs. 6–7, public code
SCALE_MIN = 2.0 ** -100   # the spec's smallest scale (taco_jax/numerics/quant.py says why)


@dataclasses.dataclass(frozen=True)
class Fmt:
    """A code grid: Qmax, and for floats the mantissa bits and the smallest normal exponent."""
    name: str
    qmax: float
    mant_bits: int | None = None     # None: integer grid
    emin: int | None = None

    def step(self, y: np.ndarray) -> np.ndarray:
        """Grid spacing around |y| (float formats)."""
        e = np.floor(np.log2(np.maximum(np.abs(y), 2.0 ** self.emin)))
        return 2.0 ** (np.maximum(e, self.emin) - self.mant_bits)


E4M3 = Fmt("e4m3", 448.0, 3, -6)
E5M2 = Fmt("e5m2", 57344.0, 2, -14)
INT8 = Fmt("int8", 127.0)
FORMATS = {"e4m3": E4M3, "e5m2": E5M2, "int8": INT8}


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a codec name means, per the issue: transform, scale granularity, code grid."""
    transform: str      # "ash" (α then Hadamard) | "hadamard" | "none"
    per_tensor: bool
    fmt: Fmt

    @property
    def n_scales(self) -> int:
        return 2 if self.transform == "ash" else 1


SPECS = {
    "taco": Spec("ash", False, E4M3),
    "taco-e5m2": Spec("ash", False, E5M2),
    "taco-int8": Spec("ash", False, INT8),
    "taco-1scale": Spec("hadamard", False, E4M3),
    "fp8": Spec("none", True, E4M3),
    "block-fp8": Spec("none", False, E4M3),
    "hadamard-fp8": Spec("hadamard", True, E4M3),
}


# -- Hadamard -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def sylvester(n: int) -> np.ndarray:
    """H_n by Kronecker products of H_2 = [[1, 1], [1, -1]] (unnormalised, symmetric)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.kron(h, np.array([[1.0, 1.0], [1.0, -1.0]]))
    assert h.shape[0] == n, f"{n} is not a power of two"
    return h


def factors(b: int) -> tuple[int, int]:
    r = 2 ** (int(np.log2(b)) // 2)
    return r, b // r


@functools.lru_cache(maxsize=None)
def wire_perm(b: int) -> np.ndarray:
    """perm[k] = natural (Sylvester) index stored at wire position k = j·r + m → m·c + j."""
    r, c = factors(b)
    j, m = np.divmod(np.arange(b), r)
    return m * c + j


def hadamard(blocks: np.ndarray) -> np.ndarray:
    """(nb, B) → normalised coefficients H_B x/√B in wire order (eq. 8 without α)."""
    b = blocks.shape[1]
    z = blocks @ sylvester(b).T / np.sqrt(b)
    return z[:, wire_perm(b)]


def inverse_hadamard(z: np.ndarray) -> np.ndarray:
    """Inverse of `hadamard` (eq. 12): H_B/√B is symmetric and orthogonal."""
    b = z.shape[1]
    nat = np.empty_like(z)
    nat[:, wire_perm(b)] = z
    return nat @ sylvester(b) / np.sqrt(b)


# -- code grids ---------------------------------------------------------------------------
def round_to_grid(y: np.ndarray, fmt: Fmt) -> np.ndarray:
    """eq. 10's cast for |y| ≤ Qmax: round-to-nearest-even onto the FP8 grid (subnormals
    included); int8 rounds half up, floor(y + 0.5), as the spec says."""
    if fmt.mant_bits is None:
        return np.floor(y + 0.5)
    step = fmt.step(y)
    return np.round(y / step) * step            # np.round: half to even


def grid_neighbours(y: np.ndarray, fmt: Fmt) -> tuple[np.ndarray, np.ndarray]:
    """The two grid points around y (equal where y is on the grid)."""
    if fmt.mant_bits is None:
        return np.floor(y), np.ceil(y)
    step = fmt.step(y)
    lo, hi = np.floor(y / step) * step, np.ceil(y / step) * step
    return lo, hi


def decode_code_bytes(codes: np.ndarray, fmt: Fmt) -> np.ndarray:
    """uint8 code bytes → float64 values, by bit arithmetic (e4m3fn: bias 7, 0x7f/0xff NaN,
    no Inf; e5m2: bias 15, exponent 31 = Inf/NaN; int8: two's complement)."""
    codes = np.asarray(codes, np.uint8)
    if fmt.mant_bits is None:
        return codes.view(np.int8).astype(np.float64)
    m_bits, e_bits = fmt.mant_bits, 7 - fmt.mant_bits
    bias = 2 ** (e_bits - 1) - 1
    v = codes.astype(np.int64)
    sign = np.where(v >> 7, -1.0, 1.0)
    exp = (v >> m_bits) & (2 ** e_bits - 1)
    man = v & (2 ** m_bits - 1)
    normal = (1.0 + man / 2 ** m_bits) * 2.0 ** (exp - bias)
    sub = (man / 2 ** m_bits) * 2.0 ** (1 - bias)
    out = sign * np.where(exp == 0, sub, normal)
    if fmt is E4M3:
        out = np.where((v & 0x7F) == 0x7F, np.nan, out)
    else:
        top = exp == 2 ** e_bits - 1
        out = np.where(top & (man == 0), sign * np.inf, np.where(top, np.nan, out))
    return out


# -- the codec ----------------------------------------------------------------------------
def to_blocks(x: np.ndarray, b: int) -> np.ndarray:
    flat = np.asarray(x, np.float64).reshape(-1)
    n_blocks = max(1, -(-flat.size // b))
    out = np.zeros(n_blocks * b)
    out[:flat.size] = flat
    return out.reshape(n_blocks, b)                             # (nb, B), zero padded


@dataclasses.dataclass
class NpEncoded:
    y: np.ndarray             # (nb, B) unrounded z/s, clipped to ±Qmax (wire order)
    codes: np.ndarray         # (nb, B) code values on the grid (float64)
    s: np.ndarray             # (nb,) eq. 9
    alpha: np.ndarray | None  # (nb,) eq. 7, dual-scale codecs only


def encode(x: np.ndarray, name: str, b: int) -> NpEncoded:
    spec = SPECS[name]
    g = to_blocks(x, b)
    bad = ~np.isfinite(g).all(axis=1)
    alpha = None
    with np.errstate(over="ignore", invalid="ignore"):
        if spec.transform == "ash":
            sigma = np.sqrt(np.mean(g * g, axis=1) + EPS)                 # eq. 6
            alpha = np.clip(TAU / sigma, ALPHA_MIN, ALPHA_MAX)             # eq. 7
            alpha = np.where(bad, np.nan, alpha)       # spec: poisoned blocks carry α = NaN
            g = g * alpha[:, None]
        z = g if spec.transform == "none" else hadamard(g)                 # eq. 8
        absmax = np.max(np.abs(z), axis=1)
        if spec.per_tensor:
            absmax = np.full_like(absmax, np.max(absmax))
            bad = np.full_like(bad, bad.any())
        s = np.maximum(absmax / spec.fmt.qmax, SCALE_MIN)                   # eq. 9
        s = np.where(bad, np.nan, s)                                       # NaN rule
        y = np.clip(z / s[:, None], -spec.fmt.qmax, spec.fmt.qmax)
        codes = round_to_grid(np.nan_to_num(y), spec.fmt)                  # eq. 10
    return NpEncoded(y, codes, s, alpha)


def decode(codes: np.ndarray, s: np.ndarray, alpha: np.ndarray | None, name: str,
           shape: tuple[int, ...]) -> np.ndarray:
    """eqs. 11–13 → float64 array of `shape` (padding dropped)."""
    spec = SPECS[name]
    z = codes * s[:, None]                                                 # eq. 11
    g = z if spec.transform == "none" else inverse_hadamard(z)             # eq. 12
    if spec.transform == "ash":
        g = g / alpha[:, None]                                             # eq. 13
    n = int(np.prod(shape))
    return g.reshape(-1)[:n].reshape(shape)


def roundtrip(x: np.ndarray, name: str, b: int) -> np.ndarray:
    e = encode(x, name, b)
    return decode(e.codes, e.s, e.alpha, name, np.shape(x))


def parse_wire(data: np.ndarray, name: str, b: int):
    """Library wire buffer (nb, B + 4·n_scales) uint8 → (code values, s, α or None)."""
    spec = SPECS[name]
    data = np.asarray(data, np.uint8)
    assert data.shape[1] == b + 4 * spec.n_scales, data.shape
    codes = decode_code_bytes(data[:, :b], spec.fmt)
    scales = [np.frombuffer(np.ascontiguousarray(data[:, b + 4 * k: b + 4 * k + 4]).tobytes(),
                            "<f4").astype(np.float64) for k in range(spec.n_scales)]
    return codes, scales[0], (scales[1] if spec.n_scales == 2 else None)


def decode_wire(data: np.ndarray, name: str, b: int, shape: tuple[int, ...]) -> np.ndarray:
    codes, s, alpha = parse_wire(data, name, b)
    return decode(codes, s, alpha, name, shape)


# -- comparison helpers shared by the test files ------------------------------------------
def code_mismatches(lib_codes: np.ndarray, ref_codes: np.ndarray, fmt: Fmt,
                    rows: np.ndarray | None = None, atol: float = 0.0) -> np.ndarray:
    """Boolean mask of differing code values (over `rows` if given), after asserting that
    every difference is one step on the grid (a rounding tie, not a wrong code) or, with
    `atol`, at most atol in code units (for computations with a known absolute error)."""
    a, b = np.asarray(lib_codes, np.float64), np.asarray(ref_codes, np.float64)
    if rows is not None:
        a, b = a[rows], b[rows]
    diff = a != b
    if diff.any():
        big = np.maximum(np.abs(a[diff]), np.abs(b[diff]))
        step = np.ones_like(big) if fmt.mant_bits is None else fmt.step(big)
        far = np.abs(a[diff] - b[diff]) > np.maximum(step, atol)
        assert not far.any(), (
            f"{far.sum()} codes differ by more than one {fmt.name} step, e.g. "
            f"{a[diff][far][:5]} vs {b[diff][far][:5]}")
    return diff


def rel_l2(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64 (0 when both are zero)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    nb = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / nb) if nb else float(np.linalg.norm(a))


def block_rel_max(a, b) -> float:
    """max over blocks (rows) of max|a − b| / max|b| — the kernel-vs-reference metric: the
    transform mixes a block, so errors scale with the block's largest value."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    den = np.max(np.abs(b), axis=1)
    num = np.max(np.abs(a - b), axis=1)
    return float(np.max(np.where(den > 0, num / np.where(den > 0, den, 1), num)))
