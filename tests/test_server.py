"""`python -m dvp_jax.serve.server`: end to end in one subprocess on a free loopback port.

64 concurrent Decode requests complete; malformed requests get INVALID_ARGUMENT and the server
keeps serving; SIGTERM shuts it down cleanly (exit code 0). In this process: a port that is
already in use stops the server at once with one line naming the address (exit code 2), and
`serve` never leaves a driver thread running; every checkpoint flag loads the same weights.
"""

import asyncio
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import portpicker
import pytest
from jetstream.core.proto import jetstream_pb2 as pb
from jetstream.core.proto import jetstream_pb2_grpc as pb_grpc

from tests import child_env

MAX_PREFILL, MAX_DECODE = 16, 8


def _text(text, max_tokens=3, **kwargs):
    return pb.DecodeRequest(
        text_content=pb.DecodeRequest.TextContent(text=text), max_tokens=max_tokens, **kwargs
    )


def _tokens(ids, max_tokens=3):
    return pb.DecodeRequest(
        token_content=pb.DecodeRequest.TokenContent(token_ids=ids), max_tokens=max_tokens
    )


async def _decode(stub, request):
    samples = []
    async for response in stub.Decode(request):
        samples.append(response.stream_content.samples[0])
    return samples


async def _wait_healthy(address, proc, timeout=240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early with code {proc.returncode}")
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.OrchestratorStub(channel)
                reply = await stub.HealthCheck(pb.HealthCheckRequest(), timeout=2.0)
                if reply.is_live:
                    return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError("server did not become healthy")


async def _exercise(address, proc):
    await _wait_healthy(address, proc)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.OrchestratorStub(channel)

        # 64 concurrent requests over 8 slots, a few tokens each.
        results = await asyncio.wait_for(
            asyncio.gather(*[_decode(stub, _text(f"{i}+{i}=")) for i in range(64)]), timeout=120
        )
        assert len(results) == 64
        lengths = [sum(len(s.token_ids) for s in samples) for samples in results]
        # A random model may sample a stop token first (an empty response); never > max_tokens.
        assert max(lengths) <= 3 and sum(lengths) > 64

        # Malformed requests: each gets INVALID_ARGUMENT.
        bad = {
            "empty text": _text(""),
            "empty tokens": _tokens([]),
            "too long": _text("1" * MAX_PREFILL),  # + BOS = 17 > 16
            "token id >= vocab": _tokens([1, 5, 64]),
            "negative token id": _tokens([1, -3]),
            "untokenizable text": _text("Ünïcödé"),
            "no content": pb.DecodeRequest(max_tokens=3),
            "max_tokens 0": _text("1+1=", max_tokens=0),
        }
        for name, request in bad.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _decode(stub, request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name

        # Non-UTF-8 text cannot be built with the generated classes: send raw bytes.
        raw = _text("ab").SerializeToString().replace(b"ab", b"\xff\xfe")
        decode_raw = channel.unary_stream(
            "/jetstream_proto.Orchestrator/Decode",
            request_serializer=lambda b: b,
            response_deserializer=pb.DecodeResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in decode_raw(raw):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "UTF-8" in err.value.details()

        # Still serving, with text and with client-side token ids.
        assert await _decode(stub, _text("2*3="))
        samples = await _decode(stub, _tokens([1, 4, 5, 6], max_tokens=2))
        assert all(0 <= t < 64 for s in samples for t in s.token_ids)
        assert (await stub.HealthCheck(pb.HealthCheckRequest())).is_live


def _server_command(port):
    return [
        sys.executable,
        "-m",
        "dvp_jax.serve.server",
        "--random_init_preset=tiny",
        f"--port={port}",
        "--host=127.0.0.1",
        f"--max_prefill_length={MAX_PREFILL}",
        f"--max_decode_length={MAX_DECODE}",
        "--max_concurrent_decodes=8",
        "--tokenizer=char",
    ]


def _server_env():
    return child_env()  # the server needs one device, not the tests' 8 fake ones


def test_server_end_to_end(tmp_path):
    port = portpicker.pick_unused_port()
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen(
        _server_command(port), stdout=log, stderr=subprocess.STDOUT, env=_server_env()
    )
    try:
        asyncio.run(_exercise(f"127.0.0.1:{port}", proc))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.seek(0)
        output = log.read()
        log.close()
    assert "server stopped" in output, output[-3000:]
    # Each log record printed once (JetStream's own root handler used to print it again).
    assert output.count("serving on 127.0.0.1") == 1, output[-3000:]
    assert output.count("shutting down") == 1, output[-3000:]


def test_server_loads_hf_and_orbax_checkpoints(tmp_path):
    """--hf_checkpoint, --orbax_checkpoint (StandardCheckpointer of the fp32 nnx.State) and
    --trainer_checkpoint (a trainer run dir) all land in the rollout dtype with the same values;
    an HF export serves with the tokenizer files written next to it."""
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx

    from dvp_jax.model import TRAIN_POLICY, ModelConfig, Transformer
    from dvp_jax.model.hf_import import save_hf
    from dvp_jax.serve import server
    from dvp_jax.tokenizers import CharTokenizer, HFTokenizer

    master = Transformer(ModelConfig.preset("tiny"), TRAIN_POLICY, rngs=nnx.Rngs(3))
    save_hf(master, str(tmp_path / "hf"))
    CharTokenizer().save_hf(tmp_path / "hf")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(str(tmp_path / "orbax"), nnx.state(master))
    expected = {
        path: np.asarray(var.get_value().astype(jnp.bfloat16))
        for path, var in nnx.to_flat_state(nnx.state(master))
    }
    # A trainer run directory: Orbax CheckpointManager with the whole TrainState (params +
    # AdamW state) and the run's model_config.json; the server reads the params alone.
    import json

    import grain

    from dvp_jax.checkpoint import Checkpointer
    from dvp_jax.sharding import Sharder
    from dvp_jax.train.state import init_train_state, make_optimizer

    _, train_state, _ = init_train_state(master, make_optimizer(1e-3, 0, 0.0, 1.0), 0, Sharder())
    run = tmp_path / "run"
    ckpt = Checkpointer(str(run), keep=1)
    ckpt.save(7, train_state, iter(grain.MapDataset.range(4)), {}, force=True)
    ckpt.close()
    (run / "model_config.json").write_text(json.dumps(master.cfg.to_hf()))
    sources = {
        "hf": [f"--hf_checkpoint={tmp_path / 'hf'}", f"--tokenizer={tmp_path / 'hf'}"],
        "orbax": [f"--orbax_checkpoint={tmp_path / 'orbax'}", "--model_preset=tiny"],
        "trainer": [f"--trainer_checkpoint={run}"],
    }
    for name, args in sources.items():
        server.FLAGS(["server", *args, f"--max_prefill_length={MAX_PREFILL}"])
        try:
            engine = server.build_engine()
        finally:
            server.FLAGS.unparse_flags()
        if name == "hf":
            tok, char = engine.tokenizer, CharTokenizer()
            assert isinstance(tok, HFTokenizer)
            assert (tok.bos_id, tok.eos_id, tok.pad_id) == (char.bos_id, char.eos_id, char.pad_id)
            assert tok.encode_ids("12+34=46") == char.encode_ids("12+34=46")
        for path, var in nnx.to_flat_state(engine.params):
            value = var.get_value()
            assert value.dtype == jnp.bfloat16, (name, path)
            np.testing.assert_array_equal(
                np.asarray(value), expected[path], err_msg=f"{name} {path}"
            )


def _held_port():
    """A loopback socket listening on a free port, as another server would hold it."""
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held, held.getsockname()[1]


def test_server_on_a_busy_port_exits_with_one_line(capsys):
    """`main` on a port another socket holds stops before it loads the model: exit status 2
    and one line naming the address, no traceback (in this process; that no driver thread is
    left to keep a process alive is `test_serve_stops_the_driver_on_every_failure`)."""
    from dvp_jax.serve import server

    held, port = _held_port()
    with held:
        server.FLAGS(["server", "--random_init_preset=tiny", f"--port={port}"])
        try:
            with pytest.raises(SystemExit) as exit_info:
                server.main(["server"])
        finally:
            server.FLAGS.unparse_flags()
    output = capsys.readouterr().err
    assert exit_info.value.code == 2, output[-3000:]
    line = f"cannot bind 127.0.0.1:{port}: address already in use; pick another --port"
    assert output.strip().splitlines() == [f"error: {line} or stop the process that holds it"]
    assert "Traceback" not in output, output[-3000:]


class _FakeDriver:
    """Stands in for JetStream's `Driver`: a non-daemon thread that runs until `stop()`, which
    is what kept the old server alive after a failed bind."""

    instances: list["_FakeDriver"] = []

    def __init__(self, **kwargs):
        self._stopped = threading.Event()
        self.thread = threading.Thread(target=self._stopped.wait, name="fake-detokenize")
        self.thread.start()
        _FakeDriver.instances.append(self)

    def stop(self):
        self._stopped.set()
        self.thread.join()


def test_engine_flags_are_engine_config_fields_with_its_defaults():
    from dvp_jax.dvp.pruning import DEFAULT_LOG_RHO
    from dvp_jax.rollout.engine import EngineConfig
    from dvp_jax.serve import server

    defaults = EngineConfig()
    for name in server._ENGINE_FLAGS:
        assert server.FLAGS[name].default == getattr(defaults, name), name
    assert server.FLAGS["log_rho"].default == DEFAULT_LOG_RHO


def test_serve_stops_the_driver_on_every_failure(monkeypatch):
    """`serve` itself: a port taken between main's check and the gRPC bind raises before any
    driver exists; a failure after the driver started, or a cancellation while serving, stops
    it. No driver thread is left to keep the process alive."""
    import types

    from dvp_jax.serve import server

    fake = types.SimpleNamespace(Driver=_FakeDriver, LLMOrchestrator=lambda driver: None)
    monkeypatch.setattr(server, "_orchestrator", lambda: fake)
    monkeypatch.setattr(_FakeDriver, "instances", [])
    engine = types.SimpleNamespace(params={}, max_concurrent_decodes=1)

    held, port = _held_port()
    with held, pytest.raises(server.PortUnavailableError) as err:
        asyncio.run(server.serve(engine, "127.0.0.1", port))
    assert str(err.value).startswith(f"cannot bind 127.0.0.1:{port}: address already in use")
    assert _FakeDriver.instances == []

    def broken_add_servicer(servicer, grpc_server):
        raise RuntimeError("injected failure after the driver started")

    with monkeypatch.context() as m:
        m.setattr(server, "add_servicer", broken_add_servicer)
        with pytest.raises(RuntimeError, match="injected failure"):
            asyncio.run(server.serve(engine, "127.0.0.1", portpicker.pick_unused_port()))
    assert len(_FakeDriver.instances) == 1 and not _FakeDriver.instances[0].thread.is_alive()

    async def serve_then_cancel():
        task = asyncio.create_task(server.serve(engine, "127.0.0.1", portpicker.pick_unused_port()))
        while len(_FakeDriver.instances) < 2:  # serve awaits inside its try/finally from here
            assert not task.done(), task.exception()
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(serve_then_cancel())
    assert len(_FakeDriver.instances) == 2 and not _FakeDriver.instances[1].thread.is_alive()
