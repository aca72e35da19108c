"""TrtllmEngine's use of TensorRT-LLM checked against the recorded 1.2.1 API (no import of the package).

The recorded API is ../shared/data/apis/tensorrt_llm.json (names, parameters and fields
parsed from TensorRT-LLM's source; see its README). Checks: every keyword the pure builders
return, every keyword at each ``LLM(...)`` / ``SamplingParams(...)`` / ``KvCacheConfig(...)`` /
``CudaGraphConfig(...)`` / ``RayPlacementConfig(...)`` call in trtllm_engine.py's source (found
with ``ast``), every ``LoadFormat`` member, every ``from tensorrt_llm... import`` (recorded, or
one of the unrecorded names the module docstring marks NOT in the recorded API), every method and
RPC name it calls, and the output fields it reads; then the engine driven against a recording
stand-in for AsyncLLM: exactly the public methods, each call bound to its recorded 1.2.1
signature (release / resume for sleep and wake, no private ``_collective_rpc``). Then the PPO-loop wiring of rollout.backend=trtllm
on CPU, without TensorRT-LLM: which rank owns which replica, the placement handed to TensorRT-LLM,
the GPU share the actor leaves it, the config.json the engine starts from, and that the actor
builds the TensorRT-LLM engine (here it stops at the import, naming what to install).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import pathlib

import pytest
import torch

from aligner.config import RolloutConfig, SamplingConfig
from aligner.rollout import trtllm_engine
from aligner.rollout.trtllm_engine import build_llm_kwargs, build_sampling_kwargs, sampled_log_probs

SOURCE = pathlib.Path(trtllm_engine.__file__).read_text()


@pytest.fixture(scope="module")
def api():
    from tests.toolkit.paths import shared_path

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
    """First argument of every ``collective_rpc(...)`` call (AsyncLLM's public one)."""
    names = set()
    for node in ast.walk(ast.parse(SOURCE)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "collective_rpc":
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
    # rollout.cuda_graphs alone decides, with or without sleep (NeMo-RL's layout; the gpu test checks refits under it)
    assert build_llm_kwargs(RolloutConfig(), "/ckpt", max_seq_len=512, enable_sleep=True)["cuda_graph_config"] == graphs
    assert build_llm_kwargs(RolloutConfig(cuda_graphs=False), "/ckpt", max_seq_len=512, enable_sleep=False)["cuda_graph_config"] is None


def test_ppo_loop_llm_kwargs_are_accepted(api):
    """The keywords the actor's replica owner adds: dummy weights, a pp split, a Ray placement."""
    from aligner.config import ParallelConfig

    accepted = set(api["tensorrt_llm.LLM.accepted_kwargs"]["all"])
    cfg = RolloutConfig(parallel=ParallelConfig(tp_size=2, pp_size=2, pp_layer_split=[3, 1]))
    place = {"placement_groups": ["pg"], "placement_bundle_indices": [[0, 0, 0, 0]], "per_worker_gpu_share": 0.1}
    kw = build_llm_kwargs(cfg, "/ckpt", max_seq_len=512, dummy_weights=True, placement=place)
    assert set(kw) <= accepted, set(kw) - accepted
    assert kw["pp_partition"] == [3, 1] and kw["load_format"] == "dummy" and kw["ray_placement_config"] == place
    fields = {f["name"]: f for f in api["tensorrt_llm.llmapi.llm_args.TorchLlmArgs"]["fields"]}
    assert fields["pp_partition"]["annotation"] == "Optional[List[int]]"
    assert "LoadFormat" in fields["load_format"]["annotation"] and "RayPlacementConfig" in fields["ray_placement_config"]["annotation"]
    ray_fields = field_names(api["tensorrt_llm.llmapi.llm_args.RayPlacementConfig"])
    assert set(place) <= ray_fields and "defer_workers_init" in ray_fields  # AsyncLLM sets it: workers start in setup_async
    # AsyncLLM takes the placement as its own keywords of the same names and builds the RayPlacementConfig
    async_init = {p["name"] for p in api["tensorrt_llm.llmapi.AsyncLLM.__init__"]["params"] if p["kind"] == "POSITIONAL_OR_KEYWORD"}
    assert set(place) == async_init
    assert "defer_workers_init=True" in api["tensorrt_llm.llmapi.AsyncLLM.__init__"]["note"]
    plain = build_llm_kwargs(RolloutConfig(), "/ckpt", max_seq_len=512)
    assert plain["pp_partition"] is None and plain["load_format"] == "auto" and plain["ray_placement_config"] is None


def test_load_format_and_placement_call_sites(api):
    members = set(api["tensorrt_llm.llmapi.llm_args.LoadFormat"]["members"])
    used = {
        n.attr
        for n in ast.walk(ast.parse(SOURCE))
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "LoadFormat"
    }
    assert used == {"DUMMY", "AUTO"} and used <= members
    assert call_keywords("RayPlacementConfig") == []  # AsyncLLM builds it from its own three keywords


# imports from tensorrt_llm the recorded 1.2.1 API does not hold; the module docstring marks each NOT in it
UNRECORDED_IMPORTS = {"tensorrt_llm._torch.utils.get_device_uuid", "tensorrt_llm._torch.virtual_memory.ExecutorMemoryType"}


def test_every_tensorrt_llm_import_is_recorded_or_marked(api):
    recorded = {path for sym in api.values() if isinstance(sym, dict) for path in sym.get("import_paths", [])}
    seen = set()
    for node in ast.walk(ast.parse(SOURCE)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tensorrt_llm"):
            for alias in node.names:
                seen.add(f"{node.module}.{alias.name}")
    assert seen, "no import from tensorrt_llm found"
    assert seen - recorded == UNRECORDED_IMPORTS, seen - recorded
    doc = trtllm_engine.__doc__
    for path in UNRECORDED_IMPORTS:
        module, _, name = path.rpartition(".")
        assert module in doc and name in doc, path


def test_sleep_tags_are_strings_as_release_takes_them(api):
    """AsyncLLM.release / resume (1.2.1) take tags: list[str] and send them as the 'sleep' / 'wakeup' RPC args;
    the tags are ExecutorMemoryType's string values without the start-up-only "_no_capture_*" scopes."""
    import enum

    from aligner.rollout.trtllm_engine import memory_tags

    for method in ("release", "resume"):
        params = api[f"tensorrt_llm.llmapi.AsyncLLM.{method}"]["params"]
        assert [(p["name"], p["annotation"]) for p in params] == [("tags", "list[str]")]
        assert api[f"tensorrt_llm.llmapi.AsyncLLM.{method}"]["kind"] == "async_method"
    # members of ExecutorMemoryType as TensorRT-LLM's main branch defines them (the enum is NOT in the recorded API)
    members = enum.Enum(
        "ExecutorMemoryType",
        {
            "SAMPLER": "sampler",
            "INIT_KV_CACHE": "_no_capture_init_kv_cache",
            "KV_CACHE": "kv_cache",
            "MODEL_ENGINE_MAIN": "model",
            "MODEL_WEIGHTS_MAIN": "model_weights",
            "EXTRA_RESOURCES": "executor_extra",
        },
    )
    tags = memory_tags(members)
    assert tags == ["sampler", "kv_cache", "model", "model_weights", "executor_extra"]
    assert all(isinstance(t, str) for t in tags)
    assert "return memory_tags(ExecutorMemoryType)" in SOURCE


def test_parallel_sizes_come_from_the_rollout_config():
    from aligner.config import ParallelConfig

    kw = build_llm_kwargs(RolloutConfig(parallel=ParallelConfig(tp_size=4, pp_size=2)), "/ckpt", max_seq_len=512)
    assert (kw["tensor_parallel_size"], kw["pipeline_parallel_size"]) == (4, 2)


def test_llm_call_site_keywords_are_accepted(api):
    """AsyncLLM(...) takes its three placement keywords and passes the rest to LLM.__init__ (1.2.1)."""
    init = api["tensorrt_llm.llmapi.AsyncLLM.__init__"]
    own = {p["name"] for p in init["params"] if p["kind"] == "POSITIONAL_OR_KEYWORD"}
    assert init["accepts_var_kwargs"] and "tensorrt_llm.llmapi.llm.LLM" in api["tensorrt_llm.llmapi.AsyncLLM"]["base_chain"]
    accepted = set(api["tensorrt_llm.LLM.accepted_kwargs"]["all"]) | own
    assert call_keywords("LLM") == []  # the synchronous LLM is no longer built
    calls = call_keywords("AsyncLLM")
    assert calls, "no AsyncLLM(...) call found in trtllm_engine.py"
    for kws in calls:
        assert kws <= accepted, kws - accepted
        assert own <= kws and "ray_placement_config" not in kws  # AsyncLLM would replace it
        assert {"tensor_parallel_size", "pipeline_parallel_size", "orchestrator_type", "ray_worker_extension_cls", "enable_sleep"} <= kws
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
    with pytest.raises(ValueError, match="do not run float32"):
        build_llm_kwargs(RolloutConfig(), "/ckpt", max_seq_len=8, dtype="float32")


def test_methods_and_rpcs_exist(api):
    """Every method the adapter calls on the engine is a public AsyncLLM method of 1.2.1 (no private
    ``_collective_rpc`` left); the one RPC sent by name is the WorkerExtension's update_weights."""
    allm = api["tensorrt_llm.llmapi.AsyncLLM"]
    public = set(allm["public_methods"])
    assert {"release", "resume", "update_weights", "collective_rpc", "setup_async", "generate_async", "shutdown"} <= public
    called = {
        n.func.attr
        for n in ast.walk(ast.parse(SOURCE))
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, (ast.Name, ast.Attribute))
        and (n.func.value.id if isinstance(n.func.value, ast.Name) else n.func.value.attr) == "llm"
    }
    assert called == {"setup_async", "generate_async", "update_weights", "collective_rpc", "release", "resume", "shutdown"}, called
    assert called <= public
    assert "_collective_rpc" not in SOURCE.split('"""', 2)[2]  # only the module docstring still names it
    # the synchronous LLM has no public sleep / wake / weight update in 1.2.1: why AsyncLLM
    assert not {"release", "resume", "update_weights", "collective_rpc"} & set(api["tensorrt_llm.LLM"]["public_methods"])
    rpc_params = [p["name"] for p in api["tensorrt_llm.llmapi.AsyncLLM.collective_rpc"]["params"]]
    assert rpc_params[:2] == ["method", "args"]
    gen_params = [p["name"] for p in api["tensorrt_llm.LLM.generate_async"]["params"]]
    assert gen_params[:2] == ["inputs", "sampling_params"]
    ext = api["tensorrt_llm.llmapi.rlhf_utils.WorkerExtension"]
    assert trtllm_engine.WORKER_EXTENSION in ext["import_paths"]
    assert [p["name"] for p in api["tensorrt_llm.llmapi.rlhf_utils.WorkerExtension.update_weights"]["params"]] == ["ipc_handles"]
    assert rpc_method_names() == {"update_weights"} and "update_weights" in ext["public_methods"]
    # AsyncLLM.update_weights / release / resume send the worker RPCs update_weights / sleep / wakeup (1.2.1 bodies)
    assert "'update_weights'" in api["tensorrt_llm.llmapi.AsyncLLM.update_weights"]["note"]
    assert "'sleep'" in api["tensorrt_llm.llmapi.AsyncLLM.release"]["note"]
    assert "'wakeup'" in api["tensorrt_llm.llmapi.AsyncLLM.resume"]["note"]
    assert "enable_sleep" in api["tensorrt_llm.LLM.accepted_kwargs"]["all"]


def _recorded(api: dict, method: str) -> dict:
    """The recorded 1.2.1 entry of AsyncLLM.`method` (its own, else the one it inherits from LLM)."""
    return api.get(f"tensorrt_llm.llmapi.AsyncLLM.{method}") or api[f"tensorrt_llm.LLM.{method}"]


def _signature(params: list[dict]):
    import inspect

    out = []
    for p in params:
        kind = getattr(inspect.Parameter, p["kind"])
        optional = not p["required"] and kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        out.append(inspect.Parameter(p["name"], kind, default=None if optional else inspect.Parameter.empty))
    return inspect.Signature(out)


def _recording_async_llm(api: dict, calls: list):
    """A stand-in for AsyncLLM whose methods exist only where 1.2.1's AsyncLLM has them publicly, are
    coroutines exactly where the recorded ones are (``async_method``), and bind every call to the
    recorded signature (TypeError on a keyword or arity the real method would refuse). Records
    (method, bound arguments, thread name)."""
    import threading
    from types import SimpleNamespace

    aresult = api["tensorrt_llm.executor.result.GenerationResult.aresult"]
    assert aresult["kind"] == "async_method" and "aresult" in api["tensorrt_llm.llmapi.RequestOutput"]["public_methods"]

    class Output:
        def __init__(self, prompt):
            self.prompt = prompt

        async def aresult(self):
            ids = [self.prompt[0] + 1, self.prompt[0] + 2]
            return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=[-0.5, -0.25], finish_reason="length")])

    def make(name):
        entry = _recorded(api, name)
        sig = _signature(entry["params"])

        def record(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            calls.append((name, dict(bound.arguments), threading.current_thread().name))
            return bound.arguments

        if entry["kind"] == "async_method":

            async def method(*args, **kwargs):
                record(*args, **kwargs)

        elif name == "generate_async":

            def method(*args, **kwargs):
                return Output(record(*args, **kwargs)["inputs"]["prompt_token_ids"])

        else:

            def method(*args, **kwargs):
                record(*args, **kwargs)

        return method

    names = ("setup_async", "generate_async", "update_weights", "collective_rpc", "release", "resume", "shutdown")
    assert set(names) <= set(api["tensorrt_llm.llmapi.AsyncLLM"]["public_methods"])
    return SimpleNamespace(**{n: make(n) for n in names})


def test_engine_calls_exactly_the_public_methods_with_their_recorded_signatures(api, monkeypatch):
    """TrtllmEngine's refit, generate, sleep, wake and shutdown against the recording stand-in: public
    AsyncLLM methods only (a private ``_collective_rpc`` would raise AttributeError), coroutines awaited
    on the engine's own loop thread, sleep / wake as release(tags) / resume(tags) once per transition."""
    from aligner.rollout.trtllm_engine import TrtllmEngine, _LoopThread

    calls: list = []
    engine = object.__new__(TrtllmEngine)
    engine._init_state(_recording_async_llm(api, calls), _LoopThread(), dict, cfg=RolloutConfig(), eos_token_id=2, max_seq_len=64)
    monkeypatch.setattr(engine, "_memory_tags", lambda: ["model", "kv_cache"])
    engine.onload()  # awake already: no call
    engine.update_weights_from_handles({"GPU-0": [("w", "handle")]})
    engine.finish_weight_update()
    gens = engine.generate([[1, 2], [5]], SamplingConfig(temperature=0.0, max_new_tokens=4), seeds=[3, 4])
    engine.offload()
    engine.offload()  # asleep already: no second release
    engine.onload()
    engine.shutdown()

    def params(seed):  # the SamplingParams keywords of one request (SamplingParams is `dict` here)
        return build_sampling_kwargs(SamplingConfig(temperature=0.0, max_new_tokens=4), eos_token_id=2, seed=seed, max_new_tokens=4)

    assert [(name, args) for name, args, _ in calls] == [
        ("update_weights", {"weights": {"GPU-0": [("w", "handle")]}}),
        ("collective_rpc", {"method": "update_weights", "args": (None,)}),
        ("generate_async", {"inputs": {"prompt_token_ids": [1, 2]}, "sampling_params": params(3)}),
        ("generate_async", {"inputs": {"prompt_token_ids": [5]}, "sampling_params": params(4)}),
        ("release", {"tags": ["model", "kv_cache"]}),
        ("resume", {"tags": ["model", "kv_cache"]}),
        ("shutdown", {}),
    ]
    assert {thread for _, _, thread in calls} == {"aligner-trtllm-loop"}  # every call on the engine's loop
    assert not engine._loop.thread.is_alive()  # shutdown stopped the loop
    assert [g.token_ids for g in gens] == [[2, 3], [6, 7]] and [g.rollout_log_probs for g in gens] == [[-0.5, -0.25]] * 2
    assert {g.weight_version for g in gens} == {1} and engine.weight_version == 1


def test_release_and_resume_would_refuse_a_private_or_misshaped_call(api):
    """The stand-in is strict: the synchronous LLM's private RPC does not exist on it, and a call off
    the recorded signature raises, so the test above cannot pass with either."""
    fake = _recording_async_llm(api, [])
    assert not hasattr(fake, "_collective_rpc")
    import asyncio

    with pytest.raises(TypeError):
        asyncio.run(fake.release(["model"], level=1))
    with pytest.raises(TypeError):
        asyncio.run(fake.resume())


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


# ---- the PPO loop's wiring of rollout.backend=trtllm (CPU; TensorRT-LLM is not imported) ----------------
def _trtllm_cfg(**rollout_parallel):
    """A validated torch-backend PPO config switched to trtllm afterwards: validation refuses trtllm here
    (tensorrt_llm is not installed), and these tests check only what the actor would build from it."""
    from aligner.config import AlignerConfig, ClusterConfig, ParallelConfig, ResourceConfig, TrainableRoleConfig

    cfg = AlignerConfig(
        actor=TrainableRoleConfig(parallel=ParallelConfig(dp_size=8), resources=ResourceConfig(num_nodes=2, gpus_per_node=4)),
        rollout=RolloutConfig(dtype="bfloat16", parallel=ParallelConfig(**rollout_parallel)),
        cluster=ClusterConfig(num_nodes=2, gpus_per_node=4),
    )
    cfg.rollout.backend = "trtllm"
    return cfg


def test_replicas_owners_and_bundles_over_the_actor_ranks():
    from aligner.rollout.trtllm_engine import trtllm_replica

    cfg = _trtllm_cfg(tp_size=2)  # 8 actor ranks on 2 nodes of 4: 4 replicas of 2 GPUs
    rs = [trtllm_replica(cfg, 8, rank, eos_token_id=2) for rank in range(8)]
    assert [r.replica for r in rs] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [r.owner for r in rs] == [True, False] * 4
    assert [r.bundle_index for r in rs] == [0, 0, 0, 0, 1, 1, 1, 1]  # each replica's workers on its owner's node
    assert {r.replicas for r in rs} == {4} and {r.workers for r in rs} == {2}
    assert rs[0].engine_kwargs == {
        "max_seq_len": cfg.model.max_seq_len,
        "eos_token_id": 2,
        "dtype": "bfloat16",
        "enable_sleep": True,
        "dummy_weights": True,
    }
    pp = [trtllm_replica(_trtllm_cfg(tp_size=2, pp_size=2), 8, rank, None) for rank in range(8)]
    assert [r.owner for r in pp] == [True, False, False, False] * 2 and [r.bundle_index for r in pp] == [0] * 4 + [1] * 4
    with pytest.raises(ValueError, match="one node"):  # 8 GPUs per replica, 4 per node
        trtllm_replica(_trtllm_cfg(tp_size=4, pp_size=2), 8, 0, None)


def test_ray_placement_puts_every_worker_in_the_owners_bundle(api):
    from aligner.rollout.trtllm_engine import ray_placement, trtllm_replica

    r = trtllm_replica(_trtllm_cfg(tp_size=2, pp_size=2), 8, 4, None)
    pg = object()  # stands in for the ray PlacementGroup only as an opaque value carried through
    place = ray_placement(r, pg, 0.1)
    assert place == {"placement_groups": [pg], "placement_bundle_indices": [[1, 1, 1, 1]], "per_worker_gpu_share": 0.1}
    # RayPlacementConfig's validator: groups and indices together, equal lengths; RayExecutor: indices = world size
    assert len(place["placement_groups"]) == len(place["placement_bundle_indices"])
    assert sum(map(len, place["placement_bundle_indices"])) == r.workers
    assert ray_placement(r, None, 0.1) is None
    share = next(f for f in api["tensorrt_llm.llmapi.llm_args.RayPlacementConfig"]["fields"] if f["name"] == "per_worker_gpu_share")
    assert share["annotation"] == "Optional[float]"


def test_the_actor_leaves_each_gpu_share_to_the_engine_worker():
    from aligner.workers.placement import TRTLLM_WORKER_GPU_SHARE, plan_from_config

    cfg = _trtllm_cfg()
    cfg.actor.resources.num_nodes, cfg.actor.resources.gpus_per_node = 1, 8
    actor = plan_from_config(cfg, ["actor"])[0].requests[0]
    assert actor.engine_gpu_share == TRTLLM_WORKER_GPU_SHARE
    assert actor.gpus_per_worker() == pytest.approx(1 - TRTLLM_WORKER_GPU_SHARE)
    assert actor.gpus_per_worker(2) == pytest.approx(0.5 - TRTLLM_WORKER_GPU_SHARE)  # colocated with one more role
    cfg.rollout.backend = "torch"
    assert plan_from_config(cfg, ["actor"])[0].requests[0].gpus_per_worker() == 1.0


def test_engine_model_dir_is_the_policys_hf_config(tmp_path):
    from aligner.config import ModelConfig
    from aligner.model.hf import model_config_from_hf, read_hf_config
    from aligner.rollout.trtllm_engine import write_engine_model_dir

    model = ModelConfig(num_kv_heads=2, tie_word_embeddings=True)
    path = write_engine_model_dir(model, str(tmp_path / "engine"))
    hf = read_hf_config(path)
    assert hf["architectures"] == ["LlamaForCausalLM"]
    back = model_config_from_hf(hf)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "tie_word_embeddings"):
        assert getattr(back, name) == getattr(model, name), name


def test_backend_registry_maps_trtllm_to_the_adapter():
    from aligner.rollout import engine_class
    from aligner.rollout.torch_engine.engine import TorchEngine
    from aligner.rollout.trtllm_engine import TrtllmEngine

    assert engine_class("trtllm") is TrtllmEngine and engine_class("torch") is TorchEngine


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="tensorrt_llm is installed: the GPU tests build it")
def test_actor_builds_the_trtllm_engine_and_stops_at_the_import_here(tmp_path):
    """ActorWorker with rollout.backend=trtllm (one rank, no Ray) takes the TensorRT-LLM path: it writes the
    engine's config.json and constructs TrtllmEngine, which here raises the install hint at the import."""
    from aligner.config import AlignerConfig, ModelConfig
    from aligner.workers.actor import ActorWorker

    cfg = AlignerConfig(model=ModelConfig(num_layers=2), rollout=RolloutConfig(dtype="bfloat16"))
    cfg.rollout.backend = "trtllm"
    worker = ActorWorker(cfg, "actor", total_steps=1, eos_token_id=2)
    with pytest.raises(ImportError, match=r"pip install aligner\[trtllm\]"):
        worker.refit()
    assert worker.engine is None  # nothing half-built stays behind
    assert worker.trtllm.owner and worker.trtllm.replicas == 1 and worker.trtllm.engine_kwargs["eos_token_id"] == 2
    assert (pathlib.Path(worker._engine_dir.name) / "config.json").is_file()


def test_non_owner_ranks_do_not_generate():
    from aligner.rollout.trtllm_engine import ColocatedTrtllmEngine

    side = ColocatedTrtllmEngine(None, dtype="bfloat16")
    assert not side.owner and side.dtype == torch.bfloat16 and side.weight_version == 0
    with pytest.raises(RuntimeError, match="replica owner"):
        side.generate([[1, 2]], SamplingConfig())


def _handle_protocol_battery(rank, world_size):
    from aligner.rollout.trtllm_engine import ColocatedTrtllmEngine, cpu_wait_group

    group = cpu_wait_group(timeout_s=60)
    side = ColocatedTrtllmEngine(None, group=group)
    # each rank offers the handles of its own GPU; ranks 1 and 3 claim the same UUID (the first must win)
    uuid = "GPU-1" if rank == 3 else f"GPU-{rank}"
    merged = side.gather_handles({uuid: [(f"w{rank}", rank)]})
    side.offload()  # a non-owner only waits for the owners: no TensorRT-LLM call
    side.onload()
    return {"backend": torch.distributed.get_backend(group), "merged": merged}


@pytest.mark.distributed
def test_handles_of_every_rank_reach_every_owner():
    """The gather the owners send to update_weights holds every rank's GPU UUID (on a gloo wait group)."""
    from tests.toolkit.spawn import run_distributed

    out = run_distributed(_handle_protocol_battery, world_size=4)
    want = {"GPU-0": [("w0", 0)], "GPU-1": [("w1", 1)], "GPU-2": [("w2", 2)]}
    assert [r["merged"] for r in out] == [want] * 4
    assert {r["backend"] for r in out} == {"gloo"}


def test_the_split_placement_runs_trtllm_replicas_on_the_rollout_group():
    """rollout.placement=split with rollout.backend=trtllm: the rollout group's ranks form
    the replicas over the rollout group's nodes, awake (no sleep: its GPUs are its own), and it is that group,
    not the actor, that leaves each GPU's share to the engine workers."""
    from aligner.config import ResourceConfig
    from aligner.rollout.trtllm_engine import trtllm_replica
    from aligner.workers.placement import ROLLOUT_GROUP, TRTLLM_WORKER_GPU_SHARE, plan_from_config

    cfg = _trtllm_cfg(tp_size=2, dp_size=2)  # two replicas of two GPUs on the rollout group's node
    cfg.rollout.placement = "split"
    cfg.rollout.resources = ResourceConfig(num_nodes=1, gpus_per_node=4)
    rs = [trtllm_replica(cfg, 4, rank, None, num_nodes=cfg.rollout.resources.num_nodes, sleep=False) for rank in range(4)]
    assert [r.replica for r in rs] == [0, 0, 1, 1] and [r.bundle_index for r in rs] == [0] * 4  # one node, not the actor's two
    assert {r.engine_kwargs["enable_sleep"] for r in rs} == {False}
    requests = {r.role: r for g in plan_from_config(cfg, ["actor", ROLLOUT_GROUP]) for r in g.requests}
    assert requests[ROLLOUT_GROUP].engine_gpu_share == TRTLLM_WORKER_GPU_SHARE
    assert requests["actor"].engine_gpu_share == 0.0


def test_rollout_worker_builds_the_trtllm_replica_and_stops_at_the_import_here():
    """The split placement's RolloutWorker with rollout.backend=trtllm (one rank, no Ray) takes the TensorRT-LLM
    path (not aligner's torch engine): constructing it reaches TrtllmEngine, which here raises the install hint."""
    from aligner.config import AlignerConfig, ModelConfig
    from aligner.workers.rollout import RolloutWorker

    cfg = AlignerConfig(model=ModelConfig(num_layers=2), rollout=RolloutConfig(dtype="bfloat16", placement="split"))
    cfg.rollout.backend = "trtllm"
    with pytest.raises(ImportError, match=r"pip install aligner\[trtllm\]"):
        RolloutWorker(cfg, cfg.model, eos_token_id=2)
