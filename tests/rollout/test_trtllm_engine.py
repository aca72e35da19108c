"""TrtllmEngine's use of TensorRT-LLM checked against the recorded 1.2.1 API (no import of the package).

The recorded API is ../shared/data/apis/tensorrt_llm.json (names, parameters and fields
parsed from TensorRT-LLM's source; see its README). Checks: every keyword the pure builders
return, every keyword at each ``LLM(...)`` / ``SamplingParams(...)`` / ``KvCacheConfig(...)`` /
``CudaGraphConfig(...)`` call in trtllm_engine.py's source (found with ``ast``), every
method and RPC name it calls, and the output fields it reads.
"""

from __future__ import annotations

import ast
import json
import pathlib

import pytest

from aligner.config import RolloutConfig, SamplingConfig
from aligner.rollout import trtllm_engine
from aligner.rollout.trtllm_engine import build_llm_kwargs, build_sampling_kwargs, sampled_log_probs

SOURCE = pathlib.Path(trtllm_engine.__file__).read_text()


@pytest.fixture(scope="module")
def api():
    from conftest import shared_path

    return json.loads(shared_path("data", "apis", "tensorrt_llm.json").read_text())["symbols"]


def field_names(sym: dict) -> set[str]:
    return {f["name"] for f in sym["fields"] if not f["name"].startswith("_")}


def call_keywords(func_name: str) -> list[set[str]]:
    """Keyword names at every call of `func_name` (a Name or an Attribute ending in it) in the adapter."""
    calls = []
    for node in ast.walk(ast.parse(SOURCE)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name == func_name:
                calls.append({k.arg for k in node.keywords if k.arg is not None})
    return calls


def rpc_method_names() -> set[str]:
    """First argument of every ``_collective_rpc(...)`` call."""
    names = set()
    for node in ast.walk(ast.parse(SOURCE)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_collective_rpc":
            assert isinstance(node.args[0], ast.Constant), "RPC method names must be literals"
            names.add(node.args[0].value)
    return names


def test_llm_kwargs_are_accepted(api):
    accepted = set(api["tensorrt_llm.LLM.accepted_kwargs"]["all"])
    cfg = RolloutConfig()
    for sleep in (True, False):
        kw = build_llm_kwargs(cfg, "/ckpt", max_seq_len=512, enable_sleep=sleep)
        assert set(kw) <= accepted, set(kw) - accepted
    kw = build_llm_kwargs(RolloutConfig(), "/ckpt", max_seq_len=512)
    assert kw["orchestrator_type"] == "ray" and kw["ray_worker_extension_cls"] == "tensorrt_llm.llmapi.rlhf_utils.WorkerExtension"
    # orchestrator_type accepts exactly 'rpc' | 'ray' | None in 1.2.1
    torch_args = {f["name"]: f for f in api["tensorrt_llm.llmapi.llm_args.TorchLlmArgs"]["fields"]}
    assert "'ray'" in torch_args["orchestrator_type"]["annotation"]
    assert kw["sampler_type"] in {m.strip("'") for m in api["tensorrt_llm.llmapi.llm_args.SamplerType"]["members"].values()}
    assert set(kw["kv_cache_config"]) <= field_names(api["tensorrt_llm.llmapi.llm_args.KvCacheConfig"])
    graphs = build_llm_kwargs(RolloutConfig(), "/ckpt", max_seq_len=512, enable_sleep=False)["cuda_graph_config"]
    assert graphs is not None and set(graphs) <= field_names(api["tensorrt_llm.llmapi.llm_args.CudaGraphConfig"])


def test_parallel_sizes_come_from_the_rollout_config():
    from aligner.config import ParallelConfig

    kw = build_llm_kwargs(RolloutConfig(parallel=ParallelConfig(tp_size=4, pp_size=2)), "/ckpt", max_seq_len=512)
    assert (kw["tensor_parallel_size"], kw["pipeline_parallel_size"]) == (4, 2)


def test_llm_call_site_keywords_are_accepted(api):
    accepted = set(api["tensorrt_llm.LLM.accepted_kwargs"]["all"])
    calls = call_keywords("LLM")
    assert calls, "no LLM(...) call found in trtllm_engine.py"
    for kws in calls:
        assert kws <= accepted, kws - accepted
        assert {"tensor_parallel_size", "pipeline_parallel_size", "orchestrator_type", "ray_worker_extension_cls"} <= kws
    for cls, _sym in (("KvCacheConfig", "KvCacheConfig"), ("CudaGraphConfig", "CudaGraphConfig")):
        assert call_keywords(cls) == [set()]  # built from the dict of build_llm_kwargs (**kw), checked above


def test_sampling_kwargs_are_accepted(api):
    accepted = {p["name"] for p in api["tensorrt_llm.SamplingParams"]["init_params"]}
    for s in (SamplingConfig(), SamplingConfig(temperature=0.0, top_k=5, top_p=0.9, stop_token_ids=[7])):
        kw = build_sampling_kwargs(s, eos_token_id=2, seed=11)
        assert set(kw) <= accepted, set(kw) - accepted
    kw = build_sampling_kwargs(
        SamplingConfig(temperature=0.7, top_k=0, top_p=0.9, max_new_tokens=33, stop_token_ids=[9, 7]), eos_token_id=2, seed=5
    )
    assert kw["max_tokens"] == 33 and kw["top_k"] is None and kw["stop_token_ids"] == [7, 9] and kw["seed"] == 5
    assert kw["logprobs"] == 0 and kw["temperature"] == 0.7 and kw["end_id"] == 2
    assert build_sampling_kwargs(SamplingConfig(max_new_tokens=33), eos_token_id=2, max_new_tokens=5)["max_tokens"] == 5  # per request
    assert "logprobs_mode" not in accepted  # 1.2.1 has no raw/processed switch (see the module docstring)
    for call in call_keywords("_SamplingParams"):
        assert call <= accepted


def test_bad_sampling_is_refused_before_tensorrt_llm():
    bad = SamplingConfig()
    object.__setattr__(bad, "top_p", 0.0)
    with pytest.raises(ValueError, match="top_p"):
        build_sampling_kwargs(bad, eos_token_id=None)
    with pytest.raises(ValueError, match="dtype"):
        build_llm_kwargs(RolloutConfig(), "/ckpt", max_seq_len=8, dtype="fp8")


def test_methods_and_rpcs_exist(api):
    llm = api["tensorrt_llm.LLM"]
    assert "_collective_rpc" in llm["private_methods"] and {"generate", "shutdown"} <= set(llm["public_methods"])
    rpc_params = [p["name"] for p in api["tensorrt_llm.LLM._collective_rpc"]["params"]]
    assert rpc_params[:2] == ["method", "args"]
    gen_params = {p["name"] for p in api["tensorrt_llm.LLM.generate"]["params"]}
    assert {"sampling_params", "use_tqdm"} <= gen_params
    ext = api["tensorrt_llm.llmapi.rlhf_utils.WorkerExtension"]
    assert trtllm_engine.WORKER_EXTENSION in ext["import_paths"]
    assert [p["name"] for p in api["tensorrt_llm.llmapi.rlhf_utils.WorkerExtension.update_weights"]["params"]] == ["ipc_handles"]
    rpcs = rpc_method_names()
    assert "update_weights" in set(ext["public_methods"]) & rpcs
    # sleep / wakeup are the worker RPCs AsyncLLM.release / resume call in 1.2.1
    assert (
        "'sleep'" in api["tensorrt_llm.llmapi.AsyncLLM.release"]["note"]
        and "'wakeup'" in api["tensorrt_llm.llmapi.AsyncLLM.resume"]["note"]
    )
    assert rpcs == {"update_weights", "sleep", "wakeup"}
    assert "enable_sleep" in api["tensorrt_llm.LLM.accepted_kwargs"]["all"]


def test_output_fields_read_exist(api):
    out = {f["name"] for f in api["tensorrt_llm.llmapi.CompletionOutput"]["fields"]}
    assert {"token_ids", "logprobs", "finish_reason"} <= out
    assert "outputs" in api["tensorrt_llm.llmapi.RequestOutput"]["properties"]
    assert "logprob" in {f["name"] for f in api["tensorrt_llm.executor.result.Logprob"]["fields"]}
    finish = next(f for f in api["tensorrt_llm.llmapi.CompletionOutput"]["fields"] if f["name"] == "finish_reason")
    assert "'stop'" in finish["annotation"] and "'length'" in finish["annotation"]
    import_paths = set(api["tensorrt_llm.llmapi.llm_args.KvCacheConfig"]["import_paths"]) | set(
        api["tensorrt_llm.llmapi.llm_args.CudaGraphConfig"]["import_paths"]
    )
    assert {"tensorrt_llm.llmapi.KvCacheConfig", "tensorrt_llm.llmapi.CudaGraphConfig"} <= import_paths
    assert "tensorrt_llm.SamplingParams" in api["tensorrt_llm.SamplingParams"]["import_paths"]


def test_sampled_log_probs_reads_token_logprobs():
    class Lp:  # stands in for tensorrt_llm.executor.result.Logprob (fields: logprob, rank)
        def __init__(self, v):
            self.logprob = v

    assert sampled_log_probs([4, 9], [{4: Lp(-0.5)}, {9: Lp(-1.25), 3: Lp(-0.1)}]) == [-0.5, -1.25]
    assert sampled_log_probs([4], [-0.3]) == [-0.3]
    with pytest.raises(ValueError, match="logprobs=0"):
        sampled_log_probs([4, 5], [-0.3])
