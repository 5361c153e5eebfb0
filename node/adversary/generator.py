"""The dishonest generators of ``[worker] cheat``: each a subclass of the honest one.

* ``perturbed-model``: pretend to run the run's model while running a different one (a cheaper or
  corrupted model): TOPLOC's exponent/mantissa checks must catch the changed activations.
* ``fake-rewards``: claim more reward than the verifier gave, advantages made consistent with the
  claim: the validator's reward check must catch it.
* ``cherry-pick``: solve the easiest-looking of a few tasks drawn at other steps instead of the
  drawn ones: the validator's task check must catch it.
* ``early-exit``: half of every group's completions become a program that exits before any test
  runs (``raise SystemExit``), claimed at reward 1.0 — what a code harness that trusts exit status 0
  gave it (issue 13). Log-probs and proofs are rebuilt on the new tokens, so the proofs hold: the
  validator's verifier (node/rl/harness.py) must score it 0 and report a reward mismatch. Meant for
  code task sets; on others the claim is as false and caught the same way.

* ``free-sandbox``: every completion becomes an endless loop (``while 1:pass``) claimed at reward
  1.0, with log-probs and proofs of nothing (zero hidden states): a batch that costs no model work
  but would hold a validator's code sandbox for its whole time limit per sample were it scored
  first (issue 42). The validator's proof checks must refuse it before any sandbox runs.

* ``pasted-answers``: half of every group's completions become the task's right answer, written by
  the worker, not sampled, re-proved (log-probs and proofs rebuilt on the new tokens) and truly
  scored, the batch stating engine "vllm" where the run accepts it (issue 42 hole 1: such a batch
  once skipped the sampling replay on its own say-so). The replay must refuse it, whatever engine
  the batch names.
* ``sybil-flood``: every batch is junk (``free-sandbox``'s) signed by a key made for it, so each one
  draws on the trainers' fresh-identity pool (issue 42 hole 3: four keys once took the whole pool
  at each interval's start and locked honest newcomers out). Sent through the node's outbox, which
  keeps a refused batch and comes back exactly when the refusal's ``retry_after_ms`` says. The pool
  must still give an honest newcomer its share (node/rollouts/quota.py), and the validators must
  refuse the junk on its proofs, which bars each key from the pool.
* ``drop-groups``: leave out the group of the prompt it did worst on (a worker hiding its failures
  to lift the reward it is credited with): the validator's complete-batch check must catch it.

``replay`` generates honestly; its cheat is in the outbox (node/adversary/outbox.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ..identity import Identity
from ..proofs.capture import logits_from_hidden, recompute_decode_states
from ..rl.rollout import ScoredGroup
from ..rl.spec import DrawnStep, group_advantages, score, step_key, token_logprobs, with_length_penalty
from ..rl.tasks import Task, TaskSet, draw_task
from ..inference.generate import RolloutGenerator

PERTURB_SCALE = 0.1  # "perturbed-model": weight noise, relative to each tensor's std
FAKE_REWARD_BONUS = 0.5  # "fake-rewards": added to every claimed reward
CHERRY_PICK_CANDIDATES = 4  # "cherry-pick": draws looked at per slot
EXIT_PROGRAM = "raise SystemExit"  # "early-exit": exit status 0 before the tests (cut at max_new_tokens)
ENDLESS_PROGRAM = "while 1:pass"  # "free-sandbox": runs until the sandbox's time limit


def program_ids(tok, program: str, max_new_tokens: int) -> tuple[list[int], str]:
    """``program``'s tokens and eos, cut at the cap, and the finish reason they give."""
    ids = list(tok(program, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
    ids = ids[:max_new_tokens]  # cut: runs to the cap, finish_reason "length"
    return ids, "stop" if ids[-1] == tok.eos_token_id else "length"


class PerturbedModelGenerator(RolloutGenerator):
    def follow(self, path: Path) -> str:
        how = super().follow(path)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.engine.model.parameters():
                if p.numel() > 1:
                    noise = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
                    p.add_(noise * p.float().std().to(p.dtype) * PERTURB_SCALE)
        return how


class FakeRewardsGenerator(RolloutGenerator):
    def claim(self, groups: list[ScoredGroup]) -> list[ScoredGroup]:
        out = []
        for g in groups:
            scores = [replace(sc, task_reward=sc.task_reward + FAKE_REWARD_BONUS) for sc in g.scores]
            out.append(replace(g, scores=scores, advantages=group_advantages([sc.reward for sc in scores])))
        return out


def cherry_picked_tasks(taskset: TaskSet, run: str, peer_id: str, root: bytes, step: int, count: int) -> list[Task]:
    """Per slot, the easiest-looking (shortest prompt) of a few draws taken at other steps."""
    out = []
    for i in range(count):
        candidates = [draw_task(taskset, step_key(run, peer_id, root, step * CHERRY_PICK_CANDIDATES + c + 1), i)
                      for c in range(CHERRY_PICK_CANDIDATES)]
        out.append(min(candidates, key=lambda t: (len(t.prompt), t.id)))
    return out


class CherryPickGenerator(RolloutGenerator):
    def draw(self, step: int, policy_root: bytes) -> DrawnStep:
        drawn = super().draw(step, policy_root)
        return replace(drawn, tasks=cherry_picked_tasks(self.taskset, self.run_name, self.identity.peer_id, policy_root,
                                                        step, len(drawn.tasks)))


class DropGroupsGenerator(RolloutGenerator):
    def claim(self, groups: list[ScoredGroup]) -> list[ScoredGroup]:
        if len(groups) < 2:
            return groups
        worst = min(range(len(groups)), key=lambda i: (sum(groups[i].rewards), i))
        return [g for i, g in enumerate(groups) if i != worst]


def reproved(engine, prompt_ids: list[int], sample, ids: list[int], finish: str, temperature: float):
    """``sample`` with its completion replaced by ``ids``, and its hidden states and log-probs rebuilt
    from ``engine``'s model on them: the proofs and log-probs of a careful cheat hold."""
    tok, model = engine.tokenizer, engine.model
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    hidden = recompute_decode_states(model, [prompt_ids], [ids], pad)[0]
    lps = token_logprobs(logits_from_hidden(model, hidden), torch.tensor(ids, device=hidden.device), temperature)
    return replace(sample, completion_ids=list(ids), logprobs=[float(x) for x in lps], finish_reason=finish,
                   hidden=hidden.cpu(), text=tok.decode(ids, skip_special_tokens=True))


class EarlyExitGenerator(RolloutGenerator):
    def claim(self, groups: list[ScoredGroup]) -> list[ScoredGroup]:
        ids, finish = program_ids(self.engine.tokenizer, EXIT_PROGRAM, self.rl.max_new_tokens)
        out = []
        for g in groups:
            samples, scores = list(g.samples), list(g.scores)
            for k in range(max(1, len(samples) // 2)):
                samples[k] = reproved(self.engine, g.prompt_ids, samples[k], ids, finish, self.rl.temperature)
                scores[k] = with_length_penalty(1.0, len(ids), g.budget, self.rl)
            out.append(replace(g, samples=samples, scores=scores,
                               advantages=group_advantages([sc.reward for sc in scores])))
        return out


class PastedAnswersGenerator(RolloutGenerator):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if "vllm" in self.inference.accepted_engines():
            self.engine.name = "vllm"  # what the batch states (RolloutBatch.engine)

    def claim(self, groups: list[ScoredGroup]) -> list[ScoredGroup]:
        out = []
        for g in groups:
            ids, finish = program_ids(self.engine.tokenizer, g.task.answer or "", self.rl.max_new_tokens)
            samples, scores = list(g.samples), list(g.scores)
            for k in range(max(1, len(samples) // 2)):
                samples[k] = reproved(self.engine, g.prompt_ids, samples[k], ids, finish, self.rl.temperature)
                scores[k] = score(g.task, samples[k].text, len(ids), g.budget, self.rl, self.code_limits)
            out.append(replace(g, samples=samples, scores=scores,
                               advantages=group_advantages([sc.reward for sc in scores])))
        return out


class FreeSandboxGenerator(RolloutGenerator):
    def claim(self, groups: list[ScoredGroup]) -> list[ScoredGroup]:
        tok = self.engine.tokenizer
        ids, finish = program_ids(tok, ENDLESS_PROGRAM, self.rl.max_new_tokens)
        text = tok.decode(ids, skip_special_tokens=True)
        out = []
        for g in groups:
            width = g.samples[0].hidden.shape[1]
            samples = [replace(s, completion_ids=list(ids), logprobs=[-1.0] * len(ids), finish_reason=finish,
                               hidden=torch.zeros(len(ids), width), text=text) for s in g.samples]
            scores = [with_length_penalty(1.0, len(ids), g.budget, self.rl) for _ in samples]
            out.append(replace(g, samples=samples, scores=scores,
                               advantages=group_advantages([sc.reward for sc in scores])))
        return out


class SybilFloodGenerator(FreeSandboxGenerator):
    def run_step(self, *args, **kwargs):
        self.identity = Identity.generate()  # draw, seed and signature: a key nobody has seen
        return super().run_step(*args, **kwargs)


GENERATORS = {
    "": RolloutGenerator,
    "perturbed-model": PerturbedModelGenerator,
    "fake-rewards": FakeRewardsGenerator,
    "cherry-pick": CherryPickGenerator,
    "early-exit": EarlyExitGenerator,
    "replay": RolloutGenerator,  # honest batches, sent twice (see make_outbox)
    "drop-groups": DropGroupsGenerator,
    "free-sandbox": FreeSandboxGenerator,
    "pasted-answers": PastedAnswersGenerator,
    "sybil-flood": SybilFloodGenerator,
}


def make_generator(**kwargs) -> RolloutGenerator:
    """A :class:`RolloutGenerator` (same arguments) that cheats the way ``worker.cheat`` says."""
    return GENERATORS[kwargs["worker"].cheat](**kwargs)

