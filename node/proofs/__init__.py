"""Verifiable inference: TOPLOC proofs and the rollout checks around them.

* ``toploc``  — build proofs from final hidden states, verify them against a prefill (byte format of
  the reference ``toploc`` 0.1.6; Ong et al., arXiv 2501.16007).
* ``capture`` — record final hidden states during ``generate()``; recompute them by prefill; which
  positions are proven.
* ``checks``  — termination, sampling and data checks, each a pure function with a reason code.
* ``reasons`` — the ``Reason`` codes and ``CheckResult``; ``config`` — the ``[proofs]`` run-file table.

Nothing here imports the network stack (libp2p, trio, msgpack): validators and inference engines
on GPU machines use it alone. This package's ``__init__`` imports nothing, so loading the config
does not load torch.
"""
