"""AsyncLLM compiles a request's grammar on the request's thread, never on the engine thread, where the first one's
xgrammar import and vocabulary and each schema (LLMEngine.compile_constraint) would stall every running stream; a
schema that makes no grammar is still refused as the request's own error."""
import asyncio
import json
import threading

import pytest

from flashnext.engine.args import EngineArgs
from flashnext.engine.async_llm import AsyncLLM
from flashnext.engine.errors import RequestRejected
from flashnext.engine.llm_engine import LLMEngine
from flashnext.engine.sampling_params import SamplingParams
from flashnext.engine.structured import json_output
from flashnext.engine.structured.backend import GrammarBackend

pytest.importorskip("xgrammar", reason="xgrammar (a dependency) compiles the constraints")


def test_grammars_compile_off_the_engine_thread(monkeypatch):
    compiled_on = []
    constraint = GrammarBackend.constraint

    def recording(self, spec):
        compiled_on.append(threading.current_thread().name)
        return constraint(self, spec)

    monkeypatch.setattr(GrammarBackend, "constraint", recording)
    llm = AsyncLLM(LLMEngine(EngineArgs(model="tiny-qwen3-next", device="cpu", dtype="float32", max_num_seqs=2,
                                        enforce_eager=True)))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    async def run(params):
        text, last = "", None
        async for out in llm.generate([5, 6, 7, 8], params):
            text, last = text + out.text, out
        return text, last

    try:
        text, last = asyncio.run(run(SamplingParams(max_tokens=40, temperature=0.0, structured=json_output(schema))))
        assert compiled_on and llm._thread.name not in compiled_on
        assert text.lstrip().startswith("{")   # constrained from its first token
        if last.finish_reason == "stop":      # complete: the constraint held it to the schema
            assert isinstance(json.loads(text)["n"], int)
        with pytest.raises(RequestRejected):
            asyncio.run(run(SamplingParams(max_tokens=4, structured=json_output({"type": "nonsense"}))))
    finally:
        llm.shutdown()
