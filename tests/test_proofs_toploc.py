"""TOPLOC proof math and byte format on random activations (no model, no reference needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.proofs.config import FIELD_PRIME as P
from node.proofs.config import ProofsConfig
from node.proofs.reasons import Reason
from node.proofs.toploc import (
    Proof,
    ProofFormatError,
    build_proofs,
    build_proofs_many,
    evaluate,
    injective_moduli,
    interpolate,
    num_chunks,
    verify_proofs,
)

CFG = ProofsConfig()


def acts(t: int, h: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, h, generator=g).to(torch.bfloat16)


def test_interpolation_passes_through_every_point():
    rng = np.random.default_rng(0)
    x = torch.tensor(np.stack([rng.choice(P, size=128, replace=False) for _ in range(5)]), dtype=torch.int64)
    y = torch.tensor(rng.integers(0, P, size=(5, 128)), dtype=torch.int64)
    coeffs = interpolate(x, y.clone())
    assert coeffs.shape == (5, 128) and (coeffs < P).all() and (coeffs >= 0).all()
    assert torch.equal(evaluate(coeffs, x), y)


def test_interpolation_matches_a_known_polynomial():
    # 3 + 2X + X^2 through three points: the coefficients come back, lowest degree first.
    x = torch.tensor([[1, 5, 9]])
    y = 3 + 2 * x + x * x
    assert interpolate(x, y).tolist() == [[3, 2, 1]]


def test_modulus_is_the_largest_injective_one():
    small = torch.arange(128)[None, :] * 3  # all below P: P itself works
    assert injective_moduli(small).tolist() == [P]
    # 0 and P collide mod P, so the search must go lower; check against a plain scan.
    idx = torch.tensor([[0, P, 2 * P + 5, 7]])
    m = int(injective_moduli(idx)[0])
    expected = next(c for c in range(P, 3, -1) if len({int(v) % c for v in idx[0]}) == 4)
    assert m == expected < P


def test_round_trip_several_shapes():
    for t, h in [(1, 128), (32, 64), (33, 256), (100, 96), (40, 4096)]:  # 40x4096 needs the modulus search
        hidden = acts(t, h, seed=t * h)
        proofs = build_proofs(hidden, CFG.chunk_tokens, CFG.topk)
        assert len(proofs) == num_chunks(t, 32)
        verdict = verify_proofs(hidden, proofs, CFG)
        assert verdict.ok, (t, h, verdict.check)
        assert all(c.exp_mismatches == 0 and c.mant_err_mean == 0 for c in verdict.chunks)


def test_proof_bytes_layout():
    proof = build_proofs(acts(32, 64))[0]
    assert len(proof) == 2 + 2 * 128
    parsed = Proof.from_bytes(proof)
    assert int.from_bytes(proof[:2], "big") == parsed.modulus == P
    assert int.from_bytes(proof[2:4], "big") == parsed.coeffs[0]
    assert parsed.to_bytes() == proof


def test_batched_build_equals_one_by_one():
    hiddens = [acts(t, 64, seed=t) for t in (5, 32, 70)]
    assert build_proofs_many(hiddens) == [build_proofs(h) for h in hiddens]


def test_short_last_chunk_gets_fewer_points():
    hidden = acts(33, 64)  # last chunk: 1 token x 64 values < k = 128
    proofs = build_proofs(hidden)
    assert [len(p) for p in proofs] == [258, 2 + 2 * 64]
    assert verify_proofs(hidden, proofs, CFG).ok


def test_noise_passes_and_other_activations_fail():
    hidden = acts(64, 256, seed=1)
    proofs = build_proofs(hidden)
    noisy = (hidden.float() * (1 + 0.003 * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(9)))).to(
        torch.bfloat16
    )
    assert verify_proofs(noisy, proofs, CFG).ok
    verdict = verify_proofs(acts(64, 256, seed=2), proofs, CFG)
    assert verdict.reason is Reason.PROOF_EXPONENT and verdict.failed_chunk == 0


def test_fp32_activations_are_proven_as_bf16():
    hidden = torch.randn(40, 128, generator=torch.Generator().manual_seed(3))
    assert build_proofs(hidden) == build_proofs(hidden.to(torch.bfloat16))


def test_bad_activations_give_null_proofs_not_exceptions():
    assert build_proofs(torch.zeros(3, 4, 5)) == [Proof.null(128).to_bytes()]  # not (T, H)
    many = build_proofs_many([torch.zeros(2, 2, 2), acts(40, 64)])
    assert many[1] == build_proofs(acts(40, 64))


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda ps: ps[:-1], Reason.PROOF_COUNT),
        (lambda ps: ps + ps[:1], Reason.PROOF_COUNT),
        (lambda ps: [ps[0][:-2]] + ps[1:], Reason.PROOF_LENGTH),
        (lambda ps: [ps[0] + b"\x00\x00"] + ps[1:], Reason.PROOF_LENGTH),
        (lambda ps: [ps[0][:-1]] + ps[1:], Reason.PROOF_MALFORMED),  # odd length
        (lambda ps: [b""] + ps[1:], Reason.PROOF_MALFORMED),
        (lambda ps: [b"\x00"] + ps[1:], Reason.PROOF_MALFORMED),
        (lambda ps: ["text"] + ps[1:], Reason.PROOF_MALFORMED),
        (lambda ps: [None] + ps[1:], Reason.PROOF_MALFORMED),
        (lambda ps: [b"\xff\xff" + ps[0][2:]] + ps[1:], Reason.PROOF_MALFORMED),  # modulus > P
        (lambda ps: [ps[0][:2] + b"\xff\xff" + ps[0][4:]] + ps[1:], Reason.PROOF_MALFORMED),  # coeff >= P
        (lambda ps: [b"\x00\x05" + ps[0][2:]] + ps[1:], Reason.PROOF_MALFORMED),  # modulus < k
        (lambda ps: [Proof.null(128).to_bytes()] + ps[1:], Reason.PROOF_NULL),
        (lambda ps: b"".join(ps), Reason.PROOF_MALFORMED),  # not a list
        (lambda ps: [bytes(258)] + ps[1:], Reason.PROOF_NULL),
    ],
)
def test_bad_proofs_are_rejected_with_a_reason(mutate, reason):
    hidden = acts(40, 64)
    verdict = verify_proofs(hidden, mutate(build_proofs(hidden)), CFG)
    assert not verdict.ok and verdict.reason is reason, verdict.check


def test_null_proof_must_be_all_zero():
    with pytest.raises(ProofFormatError):
        Proof.from_bytes(b"\x00\x00\x00\x01")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=4))
def test_arbitrary_bytes_never_raise(blobs):
    verdict = verify_proofs(acts(40, 64), blobs, CFG)
    assert not verdict.ok  # random bytes are never a valid proof of these activations


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 70), st.sampled_from([16, 48, 128]), st.integers(1, 128), st.integers(0, 2**31))
def test_round_trip_property(t, h, k, seed):
    cfg = ProofsConfig(chunk_tokens=16, topk=k, max_exp_mismatches=0)
    hidden = acts(t, h, seed)
    assert verify_proofs(hidden, build_proofs(hidden, 16, k), cfg).ok
