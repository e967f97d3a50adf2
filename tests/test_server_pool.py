"""The server on a short page pool: JetStream's own driver and orchestrator (in this process, no
gRPC) over a `JetStreamEngine` whose pool holds 1.2 slots at full length, flooded with long
requests. Every request finishes with the tokens a full-pool server gives (greedy, float32:
a preempted request is prefilled again with what it generated, and goes on as if never
stopped), and more requests than full-length slots decode at once."""

import asyncio

import numpy as np
from flax import nnx

from dvp_jax.model import TRAIN_POLICY, ModelConfig, Transformer
from dvp_jax.rollout.engine import EngineConfig, RolloutEngine
from dvp_jax.serve import jetstream_compat  # noqa: F401  (before JetStream)
from dvp_jax.serve.jetstream import JetStreamEngine
from dvp_jax.serve.server import _orchestrator, make_driver

CFG = ModelConfig.preset("tiny", init_std=0.5)
M = 24


def _serve(engine: JetStreamEngine, prompts) -> list[list[int]]:
    from jetstream.core.proto import jetstream_pb2 as pb

    driver = make_driver(engine)
    server = _orchestrator().LLMOrchestrator(driver)

    async def one(ids):
        request = pb.DecodeRequest(
            token_content=pb.DecodeRequest.TokenContent(token_ids=ids), max_tokens=M
        )
        out = []
        async for response in server.Decode(request):
            for sample in response.stream_content.samples:
                out.extend(sample.token_ids)
        return out

    async def flood():
        try:
            return await asyncio.wait_for(asyncio.gather(*[one(p) for p in prompts]), 300)
        finally:
            # Stopped while the loop runs: JetStream's detokenize thread closes each request's
            # channel after its last token, through this loop (a closed loop there is an
            # exception, and JetStream's threads kill the process on any).
            await asyncio.get_running_loop().run_in_executor(None, driver.stop)

    return asyncio.run(flood())


def test_a_flooded_short_pool_server_finishes_every_request_with_full_pool_tokens():
    master = nnx.state(Transformer(CFG, TRAIN_POLICY, rngs=nnx.Rngs(0)))
    base = dict(
        dtype="float32",
        greedy=True,
        max_concurrent_decodes=4,
        max_prefill_length=16,
        max_decode_length=M,
        page_size=4,
        stop_tokens=(),  # the engine runs every slot to max_decode_length
    )
    rng = np.random.default_rng(0)
    prompts = [
        list(rng.integers(3, CFG.vocab_size, size=int(rng.integers(2, 12)))) for _ in range(10)
    ]
    full = JetStreamEngine(RolloutEngine(CFG, EngineConfig(**base), params=master))
    assert full._pool is None
    short_config = EngineConfig(**base, kv_pages=12)  # 1.2 slots of ceil(40 / 4) = 10 pages
    short = JetStreamEngine(RolloutEngine(CFG, short_config, params=master))
    want = _serve(full, prompts)
    got = _serve(short, prompts)
    # JetStream ends a request at its tokenizer's stop tokens (the engine here never stops
    # early): several run to max_tokens.
    assert sum(len(x) == M for x in want) >= 3
    assert got == want
    stats = short._pool.sched.stats
    assert stats.evictions > 0 and stats.device_preemptions == 0
    assert short._pool.peak > 12 // 10  # more requests than full-length slots at once
