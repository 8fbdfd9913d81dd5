"""What posttrain decides for vLLM without starting it (the engines themselves run in
tests/integration/test_vllm_engine.py): the engine's settings per device, the refusals, TRL's
importance-sampling correction by its formula, and the server's command, requests and answers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.config import load_config
from posttrain.config.errors import ConfigError
from posttrain.errors import UserError
from posttrain.generation.types import Sampling
from posttrain.generation.vllm_engine import (
    CPU_KV_FLOOR,
    cpu_threads,
    engine_settings,
    model_context,
    refuse_grown_vocabulary,
)
from posttrain.generation.vllm_server import (
    check_served_model,
    completion_body,
    completions_from,
    server_command,
    server_urls_of,
)
from posttrain.methods.grpo.losses import (
    SamplingCorrection,
    sampling_records,
    sampling_statistics,
    sampling_weights,
)
from posttrain.models.dimensions import Dimensions

DIMS = Dimensions(
    "llama",
    hidden=64,
    layers=2,
    heads=2,
    kv_heads=2,
    head_dim=32,
    vocab=1024,
    intermediate=128,
    max_positions=128,
    tied_head=False,
)


def config(**changes: Any) -> Any:
    data = {
        "type": "grpo",
        "model": {"name_or_path": "/models/tiny", "dtype": "float32"},
        "data": {"sources": ["/data/prompts.jsonl"]},
        "rewards": [{"type": "length_penalty"}],
        "use_vllm": True,
        "max_completion_length": 16,
    }
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return load_config(data=data)


def cpu(run: Any, **kw: Any) -> Any:
    return engine_settings(run, DIMS, torch.float32, device_type="cpu", longest_prompt=40, rows=8, **kw)


def test_on_a_cpu_posttrain_picks_what_the_cpu_build_needs_and_says_so() -> None:
    settings = cpu(config(), local_rank=1, local_world=2, cores=[0, 1, 2, 3])
    kwargs = settings.kwargs
    assert kwargs["enforce_eager"] and kwargs["block_size"] == 32 and "enable_sleep_mode" not in kwargs
    assert kwargs["kv_cache_memory_bytes"] == CPU_KV_FLOOR  # 8 x 56 tokens of a tiny model: the floor
    assert kwargs["max_model_len"] == 40 + 16 and kwargs["dtype"] == "float32"
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["generation_config"] == "vllm"
    assert settings.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert settings.env["VLLM_CPU_OMP_THREADS_BIND"] == "2,3"  # the second process's half of the cores
    assert (
        "KV cache 64 MiB" in settings.said
        and "cores 2,3" in settings.said
        and "no sleep mode" in settings.said
    )
    big = engine_settings(config(), DIMS, torch.bfloat16, device_type="cpu", longest_prompt=100, rows=4096)
    assert big.kwargs["kv_cache_memory_bytes"] == 2 * 2 * 64 * 4096 * 116 * 2  # the memory plan's KV cache
    assert cpu(config(vllm_kv_cache_memory="1Gi")).kwargs["kv_cache_memory_bytes"] == 2**30
    assert cpu_threads(0, 1, [0, 1]) == "0,1" and cpu_threads(2, 4, [0, 1]) == "1"


def test_on_a_gpu_the_engine_is_colocated_with_the_training_process() -> None:
    run = config(vllm_enable_sleep_mode=True, vllm_gpu_memory_utilization=0.4)
    settings = engine_settings(run, DIMS, torch.bfloat16, device_type="cuda", longest_prompt=40, rows=8)
    kwargs = settings.kwargs
    assert kwargs["distributed_executor_backend"] == "external_launcher" and kwargs["enable_sleep_mode"]
    assert (
        kwargs["gpu_memory_utilization"] == 0.4
        and "enforce_eager" not in kwargs
        and kwargs["dtype"] == "bfloat16"
    )
    assert "sleep mode level 1" in settings.said


def test_the_context_is_trls_rule() -> None:
    assert model_context(config(), DIMS, 40) == 56
    assert model_context(config(), DIMS, 120) == 128  # capped by max_position_embeddings
    assert model_context(config(vllm_max_model_length=96), DIMS, 120) == 96


def test_what_vllm_cannot_take_is_refused_in_one_line() -> None:
    with pytest.raises(UserError, match="vLLM's CPU build has no sleep mode"):
        cpu(config(vllm_enable_sleep_mode=True))
    lora = {"r": 4, "target_modules": ["q_proj"]}
    with pytest.raises(ConfigError, match="cannot load 8-bit") as refused:
        config(model={"quantization_config": {"load_in_8bit": True}, "peft_config": lora})
    assert "model.quantization_config" in str(refused.value)
    four = config(model={"quantization_config": {"load_in_4bit": True}, "peft_config": lora})
    assert cpu(four).kwargs["quantization"] == "bitsandbytes"
    from posttrain.tiny_model import build_model

    model = build_model(1024, hidden_size=64, heads=2, seed=0)
    refuse_grown_vocabulary(config(), model, DIMS)  # as loaded: fine
    model.resize_token_embeddings(1030)
    with pytest.raises(UserError, match="vocabulary grown from 1024 to 1030"):
        refuse_grown_vocabulary(config(), model, DIMS)


def trl_weights(mode: str, old: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor, low: Any, high: Any):
    """TRL 1.16's computation (grpo_trainer._generate_and_score_completions), written out."""
    diff = torch.nan_to_num((old - sampled) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high)
    bad = (ratio < (low if low is not None else -math.inf)) | (
        ratio > (high if high is not None else math.inf)
    )
    return ratio.masked_fill(bad, 0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, 2.0)])
def test_the_importance_sampling_correction_is_trls(mode: str, bounds: tuple[Any, Any]) -> None:
    generator = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=generator) * 3
    sampled = old + torch.randn(4, 6, generator=generator) * 0.6
    sampled[1, 2] = math.nan  # a token the engine gave no log-probability
    mask = torch.ones(4, 6)
    mask[2, 4:] = 0
    params = SamplingCorrection(mode, *bounds)
    weights = sampling_weights(params, old, sampled, mask)
    assert torch.equal(weights, trl_weights(mode, old, sampled, mask, *bounds))
    assert weights.shape == ((4, 1) if mode.startswith("sequence") else (4, 6))
    stats = sampling_statistics(params, old, sampled, mask, weights)
    delta = (old - sampled).abs()[mask.bool() & ~torch.isnan(sampled)]
    flat = weights.flatten() if params.sequence else weights[mask.bool()]
    expected = [delta.mean(), delta.max(), flat.min(), flat.mean(), flat.max()]
    assert torch.allclose(stats, torch.stack(expected).double())
    records = sampling_records(torch.stack([stats, stats * 2]))
    assert records["sampling/importance_sampling_ratio/min"] == pytest.approx(float(flat.min()))
    assert records["sampling/importance_sampling_ratio/max"] == pytest.approx(2 * float(flat.max()))
    assert records["sampling/sampling_logp_difference/mean"] == pytest.approx(1.5 * float(delta.mean()))
    # split over two sequence-parallel slices, each completion's sum over both: the unsplit weights
    halves = [(old[:, a:b], sampled[:, a:b], mask[:, a:b]) for a, b in ((0, 3), (3, 6))]
    partial = [torch.nan_to_num((o - e) * m, nan=0.0).sum(-1, keepdim=True) for o, e, m in halves]
    others = iter(reversed(partial))  # each slice's process adds the other's sums (an all-reduce of two)
    split = [sampling_weights(params, *half, whole=lambda mine: mine + next(others)) for half in halves]
    if params.sequence:
        assert all(torch.allclose(part, weights, atol=1e-6, rtol=0) for part in split)
    else:
        assert torch.equal(torch.cat(split, dim=1), weights)


def test_the_server_is_started_and_called_with_the_runs_settings() -> None:
    run = config(vllm_mode="server", vllm_server_port=8123)
    assert server_urls_of(run) == ["http://0.0.0.0:8123"]
    assert server_urls_of(config(vllm_mode="server", vllm_server_base_url="http://gen:9000/")) == [
        "http://gen:9000"
    ]
    pool = config(vllm_mode="server", vllm_server_base_url=["http://gen:9000", "http://gen2:9000/"])
    assert server_urls_of(pool) == ["http://gen:9000", "http://gen2:9000"]
    command, env = server_command(cpu(run, where="a server"), "127.0.0.1", 8123)
    line = " ".join(command)
    assert "--model /models/tiny --tokenizer /models/tiny --dtype float32" in line
    assert "--max-model-len 56" in line and "--enforce-eager" in line and "--generation-config vllm" in line
    assert "--logprobs-mode processed_logprobs" in line and line.endswith("--host 127.0.0.1 --port 8123")
    assert "distributed_executor_backend" not in line and "--quantization" not in line
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    body = completion_body("/models/tiny", [5, 6], Sampling(8, 0.7, 0.9, 5, 1.1), [2], 1234, True)
    assert (
        body["prompt"] == [5, 6]
        and body["seed"] == 1234
        and body["temperature"] == 0.7
        and body["top_k"] == 5
    )
    assert body["repetition_penalty"] == 1.1 and body["min_p"] == 0.0 and body["logprobs"] == 0
    greedy = completion_body("/models/tiny", [5], Sampling(8, 0.7, 0.9, 5), [2], None, False)
    assert greedy["temperature"] == 0.0 and greedy["seed"] is None and greedy["logprobs"] is None
    answers = [
        {"token_ids": [7, 2], "logprobs": {"token_logprobs": [-0.5, None]}},
        {"token_ids": [7, 8], "logprobs": {"token_logprobs": [-0.1, -0.2]}},
    ]
    completions = completions_from(answers, [2], True)
    assert completions.ids == [[7, 2], [7, 8]] and completions.truncated == [False, True]
    assert completions.logps[0][0] == -0.5 and math.isnan(completions.logps[0][1])


def test_a_server_for_another_model_or_a_shorter_context_is_refused() -> None:
    served = {"data": [{"id": "/models/tiny", "root": "/models/tiny", "max_model_len": 56}]}
    assert check_served_model(served, "/models/tiny", 56, "http://h:1") == "/models/tiny"
    with pytest.raises(UserError, match=r"serves /models/tiny, not the run's model\.name_or_path"):
        check_served_model(served, "/models/other", 56, "http://h:1")
    with pytest.raises(UserError, match="context is 56 tokens, shorter than"):
        check_served_model(served, "/models/tiny", 80, "http://h:1")


def test_the_server_of_a_gpu_run_takes_the_weights_over_nccl(tiny_model_dir: Any) -> None:
    run = config(model={"name_or_path": str(tiny_model_dir)}, vllm_mode="server")
    from posttrain.generation.vllm_server import server_settings

    gpu, gpu_env = server_command(server_settings(run, "cuda"), "0.0.0.0", 8000)
    assert gpu[gpu.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'
    assert "--gpu-memory-utilization" in gpu and "--enforce-eager" not in gpu
    assert gpu_env["VLLM_BATCH_INVARIANT"] == "1"  # a completion does not depend on its batch on a GPU
    on_cpu, cpu_env = server_command(server_settings(run, "cpu"), "0.0.0.0", 8000)
    assert "--weight-transfer-config" not in on_cpu and "--enforce-eager" in on_cpu
    assert "VLLM_BATCH_INVARIANT" not in cpu_env
    with pytest.raises(UserError, match="vllm-serve starts the server of a grpo run"):
        server_settings(config(model={"name_or_path": str(tiny_model_dir)}), "cpu")


def test_a_tied_head_is_found_and_a_layer_that_took_no_weight_is_an_error() -> None:
    """The worker extension prepares tied layers again after a push (the head of a tied model takes no weight
    of its own); any other layer without its weights stops the run in one line."""
    from posttrain.generation.vllm_engine import check_reload
    from posttrain.generation.vllm_worker import tied_layers
    from posttrain.tiny_model import build_model

    tied, untied = build_model(256, tied=True), build_model(256)
    assert list(tied_layers(tied)) == ["lm_head"] and not tied_layers(untied)
    check_reload([{"refreshed": ["lm_head"], "missing": []}], "the engine")
    with pytest.raises(
        UserError, match=r"the engine did not take the pushed weights of its QKVParallelLinear"
    ):
        check_reload([{"missing": ["QKVParallelLinear"]}, {"missing": []}], "the engine")


def test_an_engine_that_parts_from_the_trainer_is_said() -> None:
    from posttrain.methods.grpo.losses import engine_mismatch

    close = {"sampling/sampling_logp_difference/mean": 2e-6, "sampling/sampling_logp_difference/max": 1e-5}
    far = {"sampling/sampling_logp_difference/mean": 0.2, "sampling/sampling_logp_difference/max": 3.1}
    assert engine_mismatch(close, "float32") == ""
    assert engine_mismatch({"sampling/sampling_logp_difference/mean": 0.05}, "bfloat16") == ""
    line = engine_mismatch(far, "bfloat16")
    assert "0.2 nats a token on average (max 3.1), far above what bfloat16 explains" in line
    assert "not sampling from the trained weights" in engine_mismatch(far, "float32")


class _Misbehaving:
    """A server on 127.0.0.1 that answers as told: ``ok`` (JSON), ``reset`` (closes the connection),
    ``slow`` (answers after 3 s), ``error`` (HTTP 500), per path; one thread, real sockets."""

    def __init__(self, behaviour: dict[str, str]) -> None:
        import http.server
        import threading
        import time

        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                kind = outer.behaviour.get(self.path.split("?")[0], "ok")
                if kind == "reset":
                    self.connection.shutdown(2)
                    return
                if kind == "short":  # killed while writing its answer
                    self.send_response(200)
                    self.send_header("Content-Length", "936")
                    self.end_headers()
                    self.wfile.write(b'{"choices": ')
                    self.wfile.flush()
                    self.connection.shutdown(2)
                    return
                if kind == "slow":
                    time.sleep(3)
                if kind == "error":
                    self.send_error(500, "engine failed")
                    return
                body = json.dumps(outer.answers.get(self.path, {})).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

        self.behaviour = behaviour
        self.answers: dict[str, Any] = {}
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_every_way_a_server_fails_is_one_line_naming_it() -> None:
    import socket

    from posttrain.generation.server_pool import ServerClient, ServerError, ServerPool

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(ServerError, match=rf"server at {nobody} refused the connection .* while generating"):
        ServerClient(nobody, 1.0).call("/v1/completions", {}, doing="generating")
    server = _Misbehaving({"/v1/completions": "reset", "/slow": "slow", "/boom": "error", "/short": "short"})
    try:
        client = ServerClient(server.url, 1.0, request_timeout=0.5)
        with pytest.raises(ServerError, match=r"closed the connection before answering .* while generating"):
            client.call("/v1/completions", {}, doing="generating")
        with pytest.raises(ServerError, match=r"broke off its answer \(IncompleteRead") as cut:
            client.call("/short", {}, doing="generating")
        assert cut.value.lost  # its requests go to the other servers
        with pytest.raises(ServerError, match="did not answer in time while asking"):
            client.call("/slow", doing="asking")
        with pytest.raises(ServerError, match="answered HTTP 500"):
            client.call("/boom", {}, doing="pushing")
        with pytest.raises(UserError, match=rf"no vLLM server answered at {nobody} within 1 s"):
            ServerPool([nobody], 1.0, 1.0, 1.0, main=True).start(lambda client: "m")
    finally:
        server.close()


def test_a_server_that_dies_during_a_push_and_stays_away_stops_the_run_in_one_line(tmp_path: Any) -> None:
    """The weight push to a server that closes the connection mid-push: out of the pool; with no other and
    none back within vllm_server_timeout, one line naming the server, what happened and the command that starts
    one (a real push of a real model's weights to a socket that drops it)."""
    from types import SimpleNamespace

    from posttrain.generation.vllm_server import VLLMServerEngine
    from posttrain.tiny_model import build_model

    server = _Misbehaving({"/collective_rpc": "reset"})
    server.answers["/v1/models"] = {"data": [{"id": "m", "root": "m", "max_model_len": 4096}]}
    config = SimpleNamespace(
        vllm_server_base_url=server.url,
        vllm_server_timeout=2.0,
        request_timeout=5.0,
        weight_sync_timeout=5.0,
        model=SimpleNamespace(name_or_path="m", peft_config=None, peft_pretrained=None),
    )
    dist = SimpleNamespace(is_main=True, rank=0, world_size=1)
    try:
        backend = VLLMServerEngine(config, build_model(256), [2], dist, needed=64)
        with pytest.raises(UserError) as caught:
            backend.push(build_model(256))
        line = str(caught.value)
        assert f"every vLLM server of the run is lost ({server.url} closed the connection" in line
        assert (
            "within 2 s (vllm_server_timeout)" in line and "posttrain vllm-serve CONFIG --port PORT" in line
        )
        backend.close()
        assert not list(Path(backend.folder()).glob(f"posttrain-weights-{backend.nonce}-*"))
    finally:
        server.close()


def test_servers_on_one_machine_take_the_cores_they_are_given() -> None:
    import os

    from posttrain.generation.vllm_server import parse_cores

    mine = sorted(os.sched_getaffinity(0))
    assert parse_cores(f"{mine[0]}") == [mine[0]]
    assert parse_cores(f"{mine[0]}-{mine[-1]}") == mine
    with pytest.raises(UserError, match="not a core list"):
        parse_cores("a-b")
    with pytest.raises(UserError, match="are not this process's"):
        parse_cores("4096")


def test_a_pool_of_servers_is_a_list_of_addresses_each_named_once() -> None:
    from posttrain.config.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        config(vllm_mode="server", vllm_server_base_url=["http://gen:9000", "gen2:9000", "http://gen:9000/"])
    text = str(caught.value)
    assert (
        "vllm_server_base_url" in text
        and "'gen2:9000' is not an address (write it as http://host:port)" in text
    )
    assert "http://gen:9000 named twice: each server of a pool once" in text
    with pytest.raises(ConfigError, match="an empty list: name one server or more"):
        config(vllm_mode="server", vllm_server_base_url=[])


def test_vllm_serve_listens_on_the_port_of_the_runs_address() -> None:
    from posttrain.generation.vllm_server import serve_port

    assert serve_port(config(vllm_mode="server", vllm_server_port=8123)) == 8123
    assert serve_port(config(vllm_mode="server", vllm_server_base_url="http://gen:9001")) == 9001
    pool = config(vllm_mode="server", vllm_server_base_url=["http://gen:9001", "http://gen:9002"])
    assert serve_port(pool) == 8000  # a pool's servers are each given --port


def test_a_lora_run_pushes_its_adapter_alone_where_vllm_can_serve_it_and_says_why_not_elsewhere() -> None:
    from posttrain.generation.vllm_lora import adapter_push

    lora = {"r": 12, "lora_alpha": 24, "target_modules": "all-linear"}
    plain = adapter_push(config(model={"peft_config": lora}))
    assert plain.rank == 16 and "the LoRA adapter alone" in plain.said
    settings = cpu(config(model={"peft_config": lora}))
    assert settings.kwargs["enable_lora"] and settings.kwargs["max_lora_rank"] == 16
    command, env = server_command(cpu(config(vllm_mode="server", model={"peft_config": lora})), "h", 1)
    assert "--enable-lora" in command and "--max-lora-rank 16" in " ".join(command)
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert adapter_push(config()).rank == 0 and "enable_lora" not in cpu(config()).kwargs
    for change, why in (
        ({"use_dora": True}, "use_dora (vLLM does not serve DoRA)"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "trained biases"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "adapters on the embedding or the head"),
        ({"r": 1024}, "rank 1024 (vLLM serves ranks up to 512)"),
    ):
        merged = adapter_push(config(model={"peft_config": {**lora, **change}}))
        assert merged.rank == 0 and "pushed merged into the base" in merged.said and why in merged.said, (
            change
        )
