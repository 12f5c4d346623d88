"""benchmarks/serve_vllm.py's parts that run without vLLM (the run itself needs vllm on a CUDA GPU): the teacher's HF
copy that vLLM loads, the generated plugin distribution that makes vLLM's processes register the text-only Qwen3.5
class, the one-line refusal without vllm, and the agreement count."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import load_benchmark

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_teacher_hf_is_the_teacher_as_load_teacher_reads_it(tmp_path):
    """The embedded GGUF teacher (a model transformers refuses to save_pretrained: it carries its GGUF quantizer)
    saved as a plain HF directory: transformers gives the same bf16 logits from it, and its tokenizer the same ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from taylor_calibrate.teacher import embedded_teacher_path, load_teacher

    try:
        embedded_teacher_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    torch.set_num_threads(1)
    out = load_benchmark("serve_vllm").teacher_hf("smollm2-135m", tmp_path / "teacher_hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    assert "quantization_config" not in config
    teacher = load_teacher("smollm2-135m", dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    text = "def add(a, b):\n    return a + b  # café\n\tx = [1, 2]"
    ids = AutoTokenizer.from_pretrained(out)(text).input_ids
    assert ids == teacher.tokenizer(text).input_ids
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([ids])).logits, teacher.model(torch.tensor([ids])).logits)


def test_plugin_distribution_names_register_for_vllm(tmp_path):
    """In a fresh interpreter with the generated folder and benchmarks/ on PYTHONPATH (as the engine processes get
    them), importlib.metadata finds one vllm.general_plugins entry point, and loading it imports serve_vllm's
    register without importing vllm."""
    mod = load_benchmark("serve_vllm")
    root = mod.write_plugin(tmp_path / "plugin")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(BENCHMARKS)])}
    code = ("import importlib.metadata as m, sys; eps = m.entry_points(group='vllm.general_plugins'); "
            f"ep = [e for e in eps if e.name == {mod.PLUGIN_NAME!r}]; f = ep[0].load(); "
            "print(len(ep), ep[0].value, f.__name__, 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "serve_vllm:register", "register", "False"]
    assert mod.engine_env(root)["PYTHONPATH"].split(os.pathsep)[:2] == [str(root), str(BENCHMARKS)]
    assert mod.engine_env(root)["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_run_without_vllm_is_one_line(tmp_path):
    with pytest.raises(SystemExit) as e:
        load_benchmark("serve_vllm").main(["run", "--hybrid", str(tmp_path), "--teacher", str(tmp_path),
                                           "--out", str(tmp_path / "x.json")])
    assert str(e.value).startswith("serve_vllm: vllm is not installed") and "\n" not in str(e.value)
    assert not (tmp_path / "x.json").exists()


def test_grid_cells_and_agreement():
    mod = load_benchmark("serve_vllm")
    assert mod.cells("4096x1,8000x32") == [(4096, 1), (8000, 32)]
    for bad in ("4096", "4096x0", "ax1", "4096x1x2"):
        with pytest.raises(SystemExit, match="CONTEXTxSEQUENCES"):
            mod.cells(bad)
    assert mod.cells("131072x0", allow_max=True) == [(131072, 0)]
    got = mod.agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert got["fraction"] == 7 / 8 and got["identical_prompts"] == 1
    assert [p["first_divergence"] for p in got["prompts"]] == [2, None]
    assert mod.agreement([[1, 2]], [[1, 2, 3]])["prompts"][0]["first_divergence"] == 2  # a short continuation


class FakeEngine:
    """vLLM's LLMEngine as `stepped` drives it, with chunked prefill: each step decodes one token for every sequence
    past its prefill, then prefills the waiting ones in order within the step's token budget; a sequence whose
    prefill ends in a step gets its first token there. Records how many sequences decoded in each step."""

    def __init__(self, chunk):
        from types import SimpleNamespace

        self.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=chunk))
        self.reqs, self.decoded, self.aborted, self.profiled = {}, [], [], []

    def add_request(self, rid, prompt, params):
        self.reqs[rid] = {"left": len(prompt["prompt_token_ids"]), "tokens": [], "max": params.max_tokens}

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def abort_request(self, ids):
        self.aborted += ids
        for i in ids:
            self.reqs.pop(i, None)

    def start_profile(self):
        self.profiled.append(("start", len(self.decoded)))

    def stop_profile(self):
        self.profiled.append(("stop", len(self.decoded)))

    def step(self):
        from types import SimpleNamespace

        budget, out, n = self.vllm_config.scheduler_config.max_num_batched_tokens, [], 0
        for rid, r in self.reqs.items():
            if r["left"] == 0:
                r["tokens"].append(1)
                budget -= 1
                n += 1
                out.append(rid)
        for rid, r in self.reqs.items():
            if r["left"] and budget > 0:
                took = min(budget, r["left"])
                r["left"] -= took
                budget -= took
                if r["left"] == 0:
                    r["tokens"].append(1)
                    out.append(rid)
        self.decoded.append(n)
        res = [SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(token_ids=list(self.reqs[rid]["tokens"]))])
               for rid in out]
        for rid in [rid for rid, r in self.reqs.items() if len(r["tokens"]) >= r["max"]]:
            del self.reqs[rid]
        return res


def test_stepped_times_decode_only_over_steps_that_run_every_sequence(monkeypatch):
    """A batch whose prefill takes many chunks: the first sequences decode while the last prefill, yet every one is
    still running when the last prefill ends, and the timed window is `gen` intervals of steps in which all of them
    decoded; then the rest is aborted. The profiled steps lie inside that window."""
    from types import ModuleType, SimpleNamespace

    fake = ModuleType("vllm")
    fake.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    inputs = ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    mod = load_benchmark("serve_vllm")
    engine = FakeEngine(chunk=1000)
    prompts = [[0] * 2500 for _ in range(6)]  # 15 prefill steps for the batch; the first sequence ends in step 3
    gen = 16
    res = mod.stepped(SimpleNamespace(llm_engine=engine), prompts, gen, profile_steps=4)
    assert res["decode_steps"] == gen and res["generated_per_sequence"] == 1 + gen + 15 + 8
    assert res["decode_tok_s"] > 0 and res["prefill_tok_s"] > 0
    assert len(engine.aborted) == 6 and not engine.reqs
    window = engine.decoded[-(gen + 1):]  # the steps timed: the last ones before the abort
    assert window == [6] * (gen + 1)
    assert [k for k, _ in engine.profiled] == ["start", "stop"]
    assert len(engine.decoded) - gen - 1 < engine.profiled[0][1] < engine.profiled[1][1] <= len(engine.decoded)


def test_a_later_call_runs_only_the_cells_an_earlier_one_lacks(tmp_path, monkeypatch):
    """One model's grid spans calls: a second call with the same settings runs only its new cells and keeps the
    first call's; other settings run every cell again."""
    from types import SimpleNamespace

    mod = load_benchmark("serve_vllm")
    ran = []

    def fake_engine(cmd, stdout, stderr, env, timeout):
        spec = json.loads(Path(cmd[cmd.index("--spec") + 1]).read_text())
        ran.append([f"{c}x{b}" for c, b in spec["grid"]])
        rows = {f"{c}x{b}": {"sequences": b or 3, "decode_tok_s": 1.0} for c, b in spec["grid"]}
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({"grid": rows}))
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(mod.subprocess, "run", fake_engine)
    monkeypatch.setattr(mod, "engine_env", lambda plugin: {})
    a = SimpleNamespace(reuse=True, engine_timeout=10)
    spec = {"llm": {"dtype": "bfloat16"}, "grid": [(4096, 1), (4096, 8)], "greedy_prompts": [], "profile_cell": None}
    mod.run_model(a, "hybrid", "m", spec, tmp_path, tmp_path)
    second = mod.run_model(a, "hybrid", "m", {**spec, "grid": [(4096, 8), (8192, 0)]}, tmp_path, tmp_path)
    assert ran == [["4096x1", "4096x8"], ["8192x0"]]
    assert set(second["grid"]) == {"4096x1", "4096x8", "8192x0"}
    again = mod.run_model(a, "hybrid", "m", {**spec, "grid": [(4096, 1)]}, tmp_path, tmp_path)
    assert len(ran) == 2 and set(again["grid"]) == {"4096x1", "4096x8", "8192x0"}
    other = mod.run_model(a, "hybrid", "m", {**spec, "llm": {"dtype": "float32"}}, tmp_path, tmp_path)
    assert ran[-1] == ["4096x1", "4096x8"] and set(other["grid"]) == {"4096x1", "4096x8"}
