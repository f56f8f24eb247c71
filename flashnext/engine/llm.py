"""The Python API: `LLM(model).generate(prompts, params)` runs requests together to completion."""
from __future__ import annotations

from dataclasses import dataclass

from flashnext.engine.args import EngineArgs
from flashnext.engine.llm_engine import LLMEngine
from flashnext.engine.sampling_params import SamplingParams


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    cached_tokens: int


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        args = EngineArgs(model=model, **engine_args) if model else EngineArgs(**engine_args)
        self.engine = LLMEngine(args)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        results = {}
        for i, (prompt, p) in enumerate(zip(ids, plist)):
            self.engine.add_request(str(i), prompt, p)
            results[str(i)] = Completion(str(i), prompt, [], "", "", 0)
        while self.engine.has_work():
            for out in self.engine.step():
                c = results[out.request_id]
                c.token_ids += out.token_ids
                c.text += out.text
                c.cached_tokens = out.cached_tokens
                if out.finished:
                    c.finish_reason = out.finish_reason
        return [results[str(i)] for i in range(len(prompts))]
