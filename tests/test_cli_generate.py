"""`flashnext generate` prints only the generated text: greedy by default, in the checkpoint's dtype."""
import subprocess
import sys

from flashnext.engine.llm import LLM
from flashnext.engine.sampling_params import SamplingParams


def _generate(*extra):
    cmd = [sys.executable, "-m", "flashnext.cli", "generate", "--model", "tiny-qwen3-next", "--prompt", "def main():",
           "--max-tokens", "6", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout


def test_generate_prints_the_greedy_continuation_only():
    llm = LLM("tiny-qwen3-next", dtype="checkpoint")
    expected = llm.generate(["def main():"], SamplingParams(max_tokens=6, temperature=0))[0].text
    assert _generate() == expected + "\n"


def test_generate_chat_applies_the_template():
    llm = LLM("tiny-qwen3-next", dtype="checkpoint")
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "def main():"}], add_generation_prompt=True)
    expected = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0].text
    assert _generate("--chat") == expected + "\n"
