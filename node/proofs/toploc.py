"""TOPLOC proofs of inference: build them from final hidden states, check them against a prefill.

How this works (Ong et al., "TOPLOC: A Locality Sensitive Hashing Scheme for Trustless Verifiable
Inference", arXiv 2501.16007, §3; byte format of the reference implementation ``toploc`` 0.1.6):

* The generated tokens' final hidden states ``(T, H)`` (see ``node.proofs.capture`` for which
  positions) are cut into chunks of ``chunk_tokens`` positions; each chunk is flattened to one vector
  of ``chunk_tokens * H`` values (the last chunk may be shorter). Prefill activations are not proven
  (INTELLECT-2's ``skip_prefill``).
* Per chunk, the k entries of largest magnitude give k points ``(x, y)``: x = flat index in the chunk,
  y = the 16-bit pattern of the value in bf16.
* The modulus m is the largest integer ≤ 65497 for which the k indices stay distinct mod m, so the
  points ``(x mod m, y)`` define a function; the proof is the unique polynomial of degree < k over
  GF(65497) through them (65497 = 0xFFD9 is prime), found by Newton's divided differences and
  written in the monomial basis, lowest degree first.
* Bytes: m as a big-endian uint16, then the k coefficients as big-endian uint16: 2 + 2k bytes
  (258 for k = 128). A failed build yields null proofs (m = 0, coefficients 0) so a rollout is never
  lost to a crash, only rejected.
* A validator recomputes the hidden states with one prefill, takes *its own* top-k indices per
  chunk, evaluates the polynomial there and compares the results, read as bf16 bit patterns, with
  its own values: the number of exponent mismatches, and the mean and median absolute mantissa
  difference over the points whose exponents agree. Small numeric noise (other kernels, batch
  shapes, GPUs) moves mantissas a little; another model, prompt or precision moves the top-k set
  and the exponents a lot (paper §4-5).

Everything is batched over chunks in torch on the activations' device (top-k, and the field
arithmetic in int64); the only Python loops run over the k polynomial terms, never over elements.

One deliberate extension of the reference: a last chunk with fewer than k values (e.g. 1 token of a
64-wide model) gets a proof of ``min(k, n)`` points instead of failing the whole rollout; the
reference can neither build nor check such a chunk (its top-k raises), so interop is unaffected.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .config import FIELD_PRIME, ProofsConfig
from .reasons import PASS, CheckResult, Reason, fail

P = FIELD_PRIME
HEADER_BYTES = 2  # the modulus
COEFF_BYTES = 2
MODULUS_BLOCK = 64  # candidate moduli tested at once by the vectorised search
NO_MANTISSA = float(2**64)  # mean/median when no exponent matched (the reference's sentinel)


class ProofFormatError(ValueError):
    """Proof bytes that cannot be a TOPLOC proof (the remote's fault)."""


@dataclass(frozen=True)
class Proof:
    """One chunk's polynomial: ``modulus`` (0 = null proof) and its coefficients, lowest degree first."""

    modulus: int
    coeffs: tuple[int, ...]

    @property
    def is_null(self) -> bool:
        return self.modulus == 0

    def to_bytes(self) -> bytes:
        out = np.empty(1 + len(self.coeffs), dtype=">u2")
        out[0] = self.modulus
        out[1:] = self.coeffs
        return out.tobytes()

    @classmethod
    def from_bytes(cls, data: object) -> Proof:
        """Parse and range-check; raises ProofFormatError on anything a builder cannot have made."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ProofFormatError(f"proof must be bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) < HEADER_BYTES + COEFF_BYTES or len(data) % 2:
            raise ProofFormatError(f"proof of {len(data)} bytes: need 2 + 2k with k >= 1")
        words = np.frombuffer(data, dtype=">u2").astype(np.int64)
        modulus, coeffs = int(words[0]), words[1:]
        if modulus == 0:
            if coeffs.any():
                raise ProofFormatError("null proof with non-zero coefficients")
        elif not len(coeffs) <= modulus <= P:
            raise ProofFormatError(f"modulus {modulus} outside {len(coeffs)}..{P}")
        if (coeffs >= P).any():
            raise ProofFormatError(f"coefficient >= {P}")
        return cls(modulus, tuple(coeffs.tolist()))

    @classmethod
    def null(cls, k: int) -> Proof:
        return cls(0, (0,) * k)


@dataclass(frozen=True)
class ChunkResult:
    """What the validator measured on one chunk (the reference's ``VerificationResult`` + points)."""

    exp_mismatches: int
    mant_err_mean: float
    mant_err_median: float
    points: int  # k of this chunk (k, or fewer for a short last chunk)


@dataclass(frozen=True)
class ProofVerdict:
    """The decision on a sequence's proofs: ``check`` says why; ``chunks`` holds the measurements."""

    check: CheckResult
    chunks: tuple[ChunkResult, ...] = ()
    failed_chunk: int | None = None

    @property
    def ok(self) -> bool:
        return self.check.ok

    @property
    def reason(self) -> Reason:
        return self.check.reason


# --------------------------------------------------------------------------------------------
# Chunking and top-k (torch, on the activations' device)


def num_chunks(num_tokens: int, chunk_tokens: int) -> int:
    return -(-num_tokens // chunk_tokens)


@dataclass(frozen=True)
class _Points:
    """Top-k points of a group of same-size chunks: ``index`` and ``bits`` are (C, k) int64 tensors."""

    chunk_ids: list[int]
    index: torch.Tensor
    bits: torch.Tensor


def _topk_points(hidden: torch.Tensor, chunk_tokens: int, topk: int) -> list[_Points]:
    """(T, H) activations -> top-k points of every chunk, grouped by chunk size (at most 2 groups)."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden states must be (T, H), got shape {tuple(hidden.shape)}")
    x = hidden.detach().to(torch.bfloat16)  # proofs are over bf16 bit patterns, whatever the compute dtype
    t, h = x.shape
    full = t // chunk_tokens
    groups: list[tuple[list[int], torch.Tensor]] = []
    if full:
        groups.append((list(range(full)), x[: full * chunk_tokens].reshape(full, chunk_tokens * h)))
    if t % chunk_tokens:
        groups.append(([full], x[full * chunk_tokens :].reshape(1, -1)))
    out = []
    for ids, flat in groups:  # (C, n)
        k = min(topk, flat.shape[1])
        # float32 |x| holds the bf16 values exactly (same order, same ties) and is ~10x faster on CPUs.
        index = flat.float().abs().topk(k, dim=1).indices  # (C, k)
        values = flat.gather(1, index).contiguous()
        bits = values.view(torch.int16).to(torch.int64) & 0xFFFF
        out.append(_Points(ids, index, bits))
    return out


# --------------------------------------------------------------------------------------------
# Field arithmetic over GF(65497), vectorised over chunks with torch on the activations' device.
# Residues are held in float64: every intermediate (a product of two residues plus a residue, or a
# sum of 128 such products) stays below 2^53 and so is exact, and float ``fmod`` is vectorised on
# CPUs where int64 ``%`` is a scalar division (~7x slower here). Operands are kept non-negative,
# so ``fmod`` is the field's reduction.


def _mod(x: torch.Tensor) -> torch.Tensor:
    return torch.fmod(x, P)


@functools.cache
def _inverses(device: torch.device) -> torch.Tensor:
    """inv[a] = a^(p-2) mod p for every a (Fermat), as float64 on ``device``; inv[0] = 0 is never used."""
    base = torch.arange(P, dtype=torch.float64, device=device)
    result = torch.ones(P, dtype=torch.float64, device=device)
    e = P - 2
    while e:
        if e & 1:
            result = _mod(result * base)
        base = _mod(base * base)
        e >>= 1
    return result


def injective_moduli(index: torch.Tensor) -> torch.Tensor:
    """(C, k) distinct indices -> (C,) largest m ≤ 65497 keeping each row distinct mod m (0 = none)."""
    c, k = index.shape
    moduli = torch.zeros(c, dtype=torch.int64, device=index.device)
    fits = index.amax(dim=1) < P if k else torch.ones(c, dtype=torch.bool, device=index.device)
    moduli[fits] = P  # indices already distinct below the first candidate
    todo = torch.nonzero(~fits).flatten()
    top = P
    while todo.numel() and top >= k:
        cand = torch.arange(top, max(top - MODULUS_BLOCK, k - 1), -1, dtype=torch.int64, device=index.device)  # (M,)
        rem = torch.fmod(index[todo][:, None, :].double(), cand[None, :, None].double()).sort(dim=2).values
        injective = (rem.diff(dim=2) != 0).all(dim=2)  # (C', M)
        found = injective.any(dim=1)
        first = injective.int().argmax(dim=1)
        moduli[todo[found]] = cand[first[found]]
        todo = todo[~found]
        top = int(cand[-1]) - 1
    return moduli


def interpolate(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Coefficients (lowest degree first) of the polynomials through (x[c], y[c]) over GF(p).

    x, y: (C, k) non-negative int64 with each row of x distinct mod p; returns (C, k) int64.
    Newton's divided differences, then expansion of the Newton form into the monomial basis;
    O(k^2) work per chunk in 2k vector steps.
    """
    inv = _inverses(x.device)
    x = _mod(x.double())
    dd = _mod(y.double())  # (C, k)
    k = dd.shape[1]
    for j in range(1, k):  # dd[:, i] <- (dd[:, i] - dd[:, i-1]) / (x[:, i] - x[:, i-j]) for i >= j
        denom = _mod(x[:, j:] - x[:, :-j] + P).long()
        dd[:, j:] = _mod(_mod(dd[:, j:] - dd[:, j - 1 : -1] + P) * inv[denom])
    neg_x = P - x  # -x_i mod p, kept positive (x_i = 0 gives p, which reduces to 0 below)
    coeffs = torch.zeros_like(dd)  # reduced once at the end: 128 terms < p^2 stay below 2^53
    basis = torch.zeros_like(dd)  # prod_{i' < i} (X - x_i'), lowest degree first
    basis[:, 0] = 1
    for i in range(k):
        coeffs += dd[:, i : i + 1] * basis
        if i + 1 < k:  # basis <- basis * (X - x_i)
            shifted = torch.zeros_like(basis)
            shifted[:, 1:] = basis[:, :-1]
            basis = _mod(shifted + neg_x[:, i : i + 1] * basis)
    return _mod(coeffs).long()


def evaluate(coeffs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Horner: (C, k) coefficients at (C, n) non-negative points -> (C, n) int64 values in [0, p)."""
    c = coeffs.double()
    x = _mod(x.double())
    y = c[:, -1:].expand(x.shape).clone()
    for j in range(c.shape[1] - 2, -1, -1):
        y = _mod(y * x + c[:, j : j + 1])
    return y.long()


# --------------------------------------------------------------------------------------------
# Build


def build_proofs(hidden: torch.Tensor, chunk_tokens: int = 32, topk: int = 128) -> list[bytes]:
    """One proof per chunk of ``chunk_tokens`` decode positions of ``hidden`` (T, H).

    Never raises on bad activations: if anything fails, every proof is a null proof (as the
    reference does), which validators reject with ``Reason.PROOF_NULL``.
    """
    return build_proofs_many([hidden], chunk_tokens, topk)[0]


def build_proofs_many(
    hiddens: Sequence[torch.Tensor], chunk_tokens: int = 32, topk: int = 128
) -> list[list[bytes]]:
    """``build_proofs`` for several sequences, with the field work batched over all their chunks."""
    if chunk_tokens < 1 or topk < 1:
        raise ValueError("chunk_tokens and topk must be >= 1")  # our bug, not the activations'
    per_seq: list[list[_Points]] = []
    failed: set[int] = set()
    for s, hidden in enumerate(hiddens):
        try:
            per_seq.append(_topk_points(hidden, chunk_tokens, topk))
        except (RuntimeError, ValueError):
            failed.add(s)
            per_seq.append([])
    # Batch every group of equal k across sequences: one vectorised interpolation per k.
    by_k: dict[int, list[tuple[int, int, int]]] = {}  # k -> (seq, group, row)
    for s, groups in enumerate(per_seq):
        for g, pts in enumerate(groups):
            for r in range(len(pts.chunk_ids)):
                by_k.setdefault(pts.index.shape[1], []).append((s, g, r))
    proofs: list[dict[int, bytes]] = [{} for _ in hiddens]
    for rows in by_k.values():
        index = torch.stack([per_seq[s][g].index[r] for s, g, r in rows])  # (C, k)
        bits = torch.stack([per_seq[s][g].bits[r] for s, g, r in rows])
        moduli = injective_moduli(index)
        coeffs = interpolate(index % moduli.clamp(min=1)[:, None], bits)
        words = torch.cat([moduli[:, None], coeffs], dim=1).cpu().numpy()
        encoded = words.astype(">u2")  # (C, 1 + k): the byte format
        for (s, g, r), m, row in zip(rows, words[:, 0], encoded):
            if m == 0:
                failed.add(s)
                continue
            proofs[s][per_seq[s][g].chunk_ids[r]] = row.tobytes()
    out = []
    for s, hidden in enumerate(hiddens):
        n = num_chunks(int(hidden.shape[0]) if hidden.dim() >= 1 else 0, chunk_tokens)
        if s in failed:
            out.append([Proof.null(topk).to_bytes()] * n)
        else:
            out.append([proofs[s][i] for i in range(n)])
    return out


# --------------------------------------------------------------------------------------------
# Verify


def _fp_parts(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 bit patterns -> (exponent bits, mantissa bits); the sign is not compared (as the reference)."""
    return (bits & 0x7F80) >> 7, bits & 0x7F


def measure_proofs(
    hidden: torch.Tensor, proofs: Sequence[Proof], chunk_tokens: int, topk: int
) -> list[ChunkResult]:
    """Per-chunk exponent mismatches and mantissa error mean/median, as the reference computes them.

    ``proofs`` must already be parsed, non-null, one per chunk, with ``min(topk, chunk size)``
    coefficients each (``verify_proofs`` checks all that first).
    """
    results: dict[int, ChunkResult] = {}
    for pts in _topk_points(hidden, chunk_tokens, topk):
        dev = pts.index.device
        moduli = torch.tensor([proofs[i].modulus for i in pts.chunk_ids], dtype=torch.int64, device=dev)
        coeffs = torch.tensor([proofs[i].coeffs for i in pts.chunk_ids], dtype=torch.int64, device=dev)  # (C, k)
        claimed = evaluate(coeffs, pts.index % moduli[:, None])  # (C, k)
        exp_c, mant_c = _fp_parts(claimed)
        exp_o, mant_o = _fp_parts(pts.bits)
        match = exp_c == exp_o  # (C, k)
        err = (mant_c - mant_o).abs()
        matched = match.sum(dim=1)  # (C,)
        mean = (err * match).sum(dim=1).double() / matched.clamp(min=1)
        # Median as the reference's C++ path: the upper middle of the sorted errors of matching points.
        ranked = torch.where(match, err, torch.full_like(err, 1 << 20)).sort(dim=1).values
        median = ranked.gather(1, (matched // 2).clamp(max=ranked.shape[1] - 1)[:, None])[:, 0]
        k = match.shape[1]
        for chunk, n, mu, med in zip(pts.chunk_ids, matched.tolist(), mean.tolist(), median.tolist()):
            if n:
                results[chunk] = ChunkResult(k - n, float(mu), float(med), k)
            else:
                results[chunk] = ChunkResult(k, NO_MANTISSA, NO_MANTISSA, k)
    return [results[i] for i in range(len(results))]


def parse_proofs(
    proofs: Sequence[object], num_tokens: int, hidden_size: int, chunk_tokens: int, topk: int
) -> tuple[list[Proof], CheckResult]:
    """Parse untrusted proof bytes for a completion of ``num_tokens``: (proofs, PASS) or ([], reason)."""
    expected = num_chunks(num_tokens, chunk_tokens)
    if not isinstance(proofs, (list, tuple)):
        return [], fail(Reason.PROOF_MALFORMED, f"proofs must be a list, got {type(proofs).__name__}")
    if len(proofs) != expected:
        return [], fail(Reason.PROOF_COUNT, f"{len(proofs)} proofs for {num_tokens} tokens, expected {expected}")
    parsed = []
    for i, raw in enumerate(proofs):
        try:
            proof = Proof.from_bytes(raw)
        except ProofFormatError as e:
            return [], fail(Reason.PROOF_MALFORMED, f"chunk {i}: {e}")
        if proof.is_null:
            return [], fail(Reason.PROOF_NULL, f"chunk {i}: null proof (the builder failed)")
        size = min(chunk_tokens, num_tokens - i * chunk_tokens) * hidden_size
        if len(proof.coeffs) != min(topk, size):
            return [], fail(
                Reason.PROOF_LENGTH, f"chunk {i}: {len(proof.coeffs)} coefficients, expected {min(topk, size)}"
            )
        parsed.append(proof)
    return parsed, PASS


def judge(result: ChunkResult, config: ProofsConfig) -> CheckResult:
    """Apply the run's thresholds to one chunk's measurements."""
    allowed = config.max_exp_mismatches * result.points // config.topk
    if result.exp_mismatches > allowed:
        return fail(Reason.PROOF_EXPONENT, f"{result.exp_mismatches}/{result.points} exponent mismatches > {allowed}")
    if result.mant_err_mean > config.max_mantissa_mean:
        return fail(Reason.PROOF_MANTISSA_MEAN, f"mantissa error mean {result.mant_err_mean:.2f} > {config.max_mantissa_mean}")
    if result.mant_err_median > config.max_mantissa_median:
        return fail(
            Reason.PROOF_MANTISSA_MEDIAN, f"mantissa error median {result.mant_err_median:.2f} > {config.max_mantissa_median}"
        )
    return PASS


def verify_proofs(hidden: torch.Tensor, proofs: Sequence[object], config: ProofsConfig) -> ProofVerdict:
    """Check a completion's untrusted ``proofs`` against the validator's own ``hidden`` (T, H).

    ``hidden`` must be the validator's recomputation of the same decode positions the builder used
    (``node.proofs.capture.decode_positions``). Never raises on bad proofs: a verdict says why.
    """
    t, h = hidden.shape
    parsed, check = parse_proofs(proofs, t, h, config.chunk_tokens, config.topk)
    if not check.ok:
        return ProofVerdict(check)
    chunks = tuple(measure_proofs(hidden, parsed, config.chunk_tokens, config.topk))
    for i, result in enumerate(chunks):
        check = judge(result, config)
        if not check.ok:
            return ProofVerdict(fail(check.reason, f"chunk {i}: {check.detail}"), chunks, i)
    return ProofVerdict(PASS, chunks)


def summarize(verdicts: Sequence[ProofVerdict]) -> dict[str, float]:
    """Worst and typical measurements over many verdicts (for logs, status and benchmarks)."""
    chunks = [c for v in verdicts for c in v.chunks]
    if not chunks:
        return {"chunks": 0}
    return {
        "chunks": len(chunks),
        "max_exp_mismatches": max(c.exp_mismatches for c in chunks),
        "max_mant_err_mean": max(c.mant_err_mean for c in chunks),
        "max_mant_err_median": max(c.mant_err_median for c in chunks),
        "median_mant_err_mean": statistics.median(c.mant_err_mean for c in chunks),
    }
