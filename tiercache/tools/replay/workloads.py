"""Built-in trace generators: ``chat``, ``system_prompt``, ``rag`` and ``none``.

Every generator is a function of its ``WorkloadParams`` (seed included): the same
parameters give the same trace, token for token. Arrivals are Poisson at ``rate_rps``
(sessions for ``chat``, requests otherwise). Lengths are log-normal around a published
mean (sigma ``LENGTH_SIGMA``: the papers give means, and their histograms are long-tailed;
the sigma is ours), clipped to ``[MIN_TOKENS, max_prompt_tokens]``:

* ``chat``: LMSYS-Chat-1M (Zheng et al., 2023, arXiv:2309.11998, Table 1): 2.0 turns per
  conversation, 69.5 tokens per user prompt, 214.5 tokens per response. Turns per session
  are 1 + geometric with that mean. Each turn re-sends the whole conversation (every
  earlier prompt and answer, the answers as the engines generate them:
  ``trace.response_token_ids``) plus a new user prompt, ``think_time_s`` (exponential;
  the mean is ours, no source) after the previous turn's arrival: the trace does not wait
  for the answer.
* ``system_prompt``: ``num_system_prompts`` shared prefixes of ``system_prompt_tokens``
  (ours, no source) picked uniformly, then a ShareGPT-length user prompt (Kwon et al.,
  SOSP 2023, "Efficient Memory Management for LLM Serving with PagedAttention", §6.1:
  ShareGPT inputs average 161.3 tokens, outputs 338.0).
* ``rag``: ``top_k`` documents of ``doc_tokens`` each (ours), drawn without replacement from
  a pool of ``num_docs`` with Zipf popularity of exponent ``zipf_s`` (0.8: inside the
  0.64-0.83 Breslau et al. measured for web requests, INFOCOM 1999), in retrieval order
  (random with respect to popularity, so a prefix is shared only up to the first
  differing document), then an LMSYS-length question and answer.
* ``none``: ShareGPT lengths, fresh random tokens: no reuse at all (the control).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from tiercache.errors import ConfigError
from tiercache.tools.replay.trace import Trace, TraceRequest, concat, response_token_ids

LENGTH_SIGMA = 1.0
MIN_TOKENS = 4
TOKEN_RANGE = (1000, 30000)

LMSYS_TURNS_MEAN = 2.0
LMSYS_PROMPT_MEAN = 69.5
LMSYS_RESPONSE_MEAN = 214.5
SHAREGPT_INPUT_MEAN = 161.3
SHAREGPT_OUTPUT_MEAN = 338.0

SOURCES = {
    "lmsys_chat_1m": "Zheng et al. 2023, LMSYS-Chat-1M, arXiv:2309.11998, Table 1: 2.0 turns, "
                     "69.5 prompt and 214.5 response tokens on average",
    "sharegpt": "Kwon et al. 2023, PagedAttention (SOSP), section 6.1: ShareGPT inputs 161.3 "
                "and outputs 338.0 tokens on average",
    "zipf": "Breslau et al. 1999, Web Caching and Zipf-like Distributions (INFOCOM): "
            "exponents 0.64-0.83",
    "ours": "log-normal sigma, think time, system prompt and document lengths: chosen here, "
            "no source",
}


class Workload(enum.Enum):
    CHAT = "chat"
    SYSTEM_PROMPT = "system_prompt"
    RAG = "rag"
    NONE = "none"

    @classmethod
    def parse(cls, name: str) -> Workload:
        try:
            return cls(name)
        except ValueError:
            raise ConfigError(f"--generate {name!r}: allowed "
                              f"{', '.join(w.value for w in cls)}") from None


@dataclass(frozen=True)
class WorkloadParams:
    """A generator's knobs (defaults: the module docstring's sources, and ours)."""

    num_requests: int = 200
    rate_rps: float = 4.0
    seed: int = 0
    max_prompt_tokens: int = 3500  # the replay's engines run max_model_len 4096
    think_time_s: float = 10.0
    num_system_prompts: int = 8
    system_prompt_tokens: int = 1024
    num_docs: int = 500
    doc_tokens: int = 512
    top_k: int = 4
    zipf_s: float = 0.8

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ConfigError(f"--requests {self.num_requests}: must be >= 1")
        if not self.rate_rps > 0:
            raise ConfigError(f"--rate {self.rate_rps}: must be > 0 (requests per second)")
        if self.top_k > self.num_docs:
            raise ConfigError(f"top_k {self.top_k} > num_docs {self.num_docs}")
        if self.top_k * self.doc_tokens + MIN_TOKENS > self.max_prompt_tokens:
            raise ConfigError(f"{self.top_k} documents of {self.doc_tokens} tokens do not fit "
                              f"max_prompt_tokens {self.max_prompt_tokens}")


class _Draw:
    """The generators' random source: one seeded numpy Generator."""

    def __init__(self, params: WorkloadParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def length(self, mean: float, cap: int | None = None) -> int:
        cap = self.params.max_prompt_tokens if cap is None else cap
        mu = np.log(mean) - LENGTH_SIGMA ** 2 / 2  # so that the mean is ``mean``
        return int(np.clip(round(self.rng.lognormal(mu, LENGTH_SIGMA)), MIN_TOKENS, cap))

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(*TOKEN_RANGE, size=n).tolist()

    def arrivals(self, n: int) -> np.ndarray:
        return np.cumsum(self.rng.exponential(1.0 / self.params.rate_rps, size=n))


def chat(params: WorkloadParams) -> list[TraceRequest]:
    draw = _Draw(params)
    requests: list[TraceRequest] = []
    session = 0
    starts = iter(draw.arrivals(params.num_requests))
    while len(requests) < params.num_requests:
        t = float(next(starts))
        turns = int(draw.rng.geometric(1.0 / LMSYS_TURNS_MEAN))
        history: tuple[int, ...] = ()
        for _ in range(turns):
            user = draw.tokens(draw.length(LMSYS_PROMPT_MEAN))
            prompt = concat((history, user))
            if len(prompt) > params.max_prompt_tokens:
                break  # the conversation outgrew the context: the user starts another
            output_len = draw.length(LMSYS_RESPONSE_MEAN, cap=1024)
            requests.append(TraceRequest(t, f"chat-{session}", prompt, output_len))
            history = concat((prompt, response_token_ids(prompt, output_len)))
            t += float(draw.rng.exponential(params.think_time_s))
        session += 1
    return requests


def system_prompt(params: WorkloadParams) -> list[TraceRequest]:
    draw = _Draw(params)
    prefixes = [draw.tokens(params.system_prompt_tokens) for _ in range(params.num_system_prompts)]
    room = params.max_prompt_tokens - params.system_prompt_tokens
    requests = []
    for i, t in enumerate(draw.arrivals(params.num_requests)):
        tenant = int(draw.rng.integers(params.num_system_prompts))
        user = draw.tokens(draw.length(SHAREGPT_INPUT_MEAN, cap=room))
        requests.append(TraceRequest(float(t), f"tenant-{tenant}-{i}",
                                     concat((prefixes[tenant], user)),
                                     draw.length(SHAREGPT_OUTPUT_MEAN, cap=1024)))
    return requests


def rag(params: WorkloadParams) -> list[TraceRequest]:
    draw = _Draw(params)
    docs = [draw.tokens(params.doc_tokens) for _ in range(params.num_docs)]
    popularity = 1.0 / np.arange(1, params.num_docs + 1) ** params.zipf_s
    popularity /= popularity.sum()
    room = params.max_prompt_tokens - params.top_k * params.doc_tokens
    requests = []
    for i, t in enumerate(draw.arrivals(params.num_requests)):
        picked = draw.rng.choice(params.num_docs, size=params.top_k, replace=False, p=popularity)
        order = draw.rng.permutation(picked)  # retrieval order, not popularity order
        question = draw.tokens(draw.length(LMSYS_PROMPT_MEAN, cap=room))
        requests.append(TraceRequest(float(t), f"rag-{i}",
                                     concat([*(docs[d] for d in order), question]),
                                     draw.length(LMSYS_RESPONSE_MEAN, cap=1024)))
    return requests


def no_reuse(params: WorkloadParams) -> list[TraceRequest]:
    draw = _Draw(params)
    return [TraceRequest(float(t), f"none-{i}",
                         tuple(draw.tokens(draw.length(SHAREGPT_INPUT_MEAN))),
                         draw.length(SHAREGPT_OUTPUT_MEAN, cap=1024))
            for i, t in enumerate(draw.arrivals(params.num_requests))]


GENERATORS: dict[Workload, Callable[[WorkloadParams], list[TraceRequest]]] = {
    Workload.CHAT: chat, Workload.SYSTEM_PROMPT: system_prompt, Workload.RAG: rag,
    Workload.NONE: no_reuse,
}


def generate(workload: Workload, params: WorkloadParams) -> Trace:
    """The trace of ``workload`` (first ``num_requests`` by arrival), with its provenance."""
    requests = sorted(GENERATORS[workload](params), key=lambda r: r.t)[:params.num_requests]
    return Trace(tuple(requests), {"generator": workload.value, "params": asdict(params),
                                   "sources": SOURCES})
