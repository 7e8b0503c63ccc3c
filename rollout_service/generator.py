"""What an episode needs from an inference engine: the `Generator` protocol, and a scripted one.

`Generator` is the whole contract between the agent loop and the engine: sample a reply
(token ids + the sampled tokens' log-probs) for a prompt of token ids with sampling
parameters and a seed, and say which policy version served it. `rollout_service.engine
.Engine` (vLLM) implements it; so does `ScriptedGenerator`, a second implementation whose
"samples" are a script of replies: the agent-loop tests (tests/test_episode.py) and the
warm start's demonstrations (`sinkflex_rl.warm_start.GoldenEngine`) run episodes with it, on
CPU, without vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from rollout_service.engine import Generation, Sampling


@runtime_checkable
class Generator(Protocol):
    """An engine as the episode sees it.

    Attributes:
        policy_version: the version of the weights new generations are served by.
        max_model_len: the context length in tokens (prompt + reply).
    """

    policy_version: int
    max_model_len: int

    async def generate(self, prompt_ids: list[int], sampling: Sampling, stop_token_ids: list[int] | None = None,
                       max_tokens: int | None = None, want_logprobs: bool = True, count: bool = True,
                       min_tokens: int = 0) -> Generation:
        """One reply to `prompt_ids` ([P] ids): at most `max_tokens` (default
        `sampling.max_new_tokens`) ids, ending with a stop token unless cut ("length"), with
        log pi(token) per id (0.0 when not `want_logprobs`) and the policy version that
        produced every id. `count=False`: a warm-up request, not counted as generated."""
        ...


def scripted_logprob(turn: int, position: int) -> float:
    """The default log-prob of the `position`-th token of scripted turn `turn`: a multiple of
    -1/8 in [-1, -1/8] (deterministic, non-zero, and exact in float32)."""
    return -0.125 * (1 + (31 * turn + position) % 8)


class ScriptedGenerator:
    """A `Generator` whose replies are a script: turn k of the episode returns `turns[k]`.

    Each reply is returned as vLLM would return it: cut at the token budget
    (`max_tokens`, finish "length") when longer, else whole (finish "stop"). Once the script
    is exhausted every reply is `end_token_id` alone (an empty reply). Warm-up requests
    (`count=False`, the agent loop's prefix-cache prefill) consume nothing. Every counted
    request's prompt is kept in `prompts` (tests check that turn k+1's prompt extends turn k's).

    Args:
        turns: [K] replies, each a sequence of token ids (normally ending with a stop token).
        end_token_id: the reply after the script (e.g. the end-of-turn id).
        logprob: (turn, position) -> log-prob of that token; default `scripted_logprob`.
        policy_version: the version every reply is served by (`policy_version` may be set
            between turns to mimic a weight update).
        max_model_len: context length the agent loop budgets against.
    """

    def __init__(self, turns: Sequence[Sequence[int]], end_token_id: int,
                 logprob: Callable[[int, int], float] = scripted_logprob, policy_version: int = 0,
                 max_model_len: int = 1 << 20):
        self.turns = [tuple(int(i) for i in t) for t in turns]
        self.end_token_id = end_token_id
        self.logprob = logprob
        self.policy_version = policy_version
        self.max_model_len = max_model_len
        self.calls = 0
        self.prompts: list[list[int]] = []

    @classmethod
    def from_texts(cls, tokenizer, texts: Sequence[str], end_token_id: int, **kwargs) -> ScriptedGenerator:
        """Replies `tokenizer.encode(text, add_special_tokens=False) + [end_token_id]` per text
        (`end_token_id`: the formatter's end-of-turn id, e.g. `ChatTemplateFormatter.eot_id`)."""
        turns = [list(tokenizer.encode(t, add_special_tokens=False)) + [end_token_id] for t in texts]
        return cls(turns, end_token_id, **kwargs)

    async def generate(self, prompt_ids, sampling, stop_token_ids=None, max_tokens=None, want_logprobs=True,
                       count=True, min_tokens=0) -> Generation:
        if not count:
            return Generation((self.end_token_id,), (0.0,), "stop", self.policy_version, 0.0)
        turn = self.calls
        self.calls += 1
        self.prompts.append(list(prompt_ids))
        ids = self.turns[turn] if turn < len(self.turns) else (self.end_token_id,)
        budget = max_tokens if max_tokens is not None else sampling.max_new_tokens
        budget = min(budget, self.max_model_len - len(prompt_ids))
        finish = "stop"
        if len(ids) > budget:  # as vLLM does: cut at the budget, nothing appended
            ids, finish = ids[:max(budget, 0)], "length"
        lps = tuple(float(self.logprob(turn, j)) if want_logprobs else 0.0 for j in range(len(ids)))
        return Generation(tuple(ids), lps, finish, self.policy_version, 0.0)
