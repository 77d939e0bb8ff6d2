"""The simulator (fourfold.plan.predict) and the planner (fourfold plan --gpus/--nproc): the pieces checked
against the formulas they stand on; the predictions against real runs live in `fourfold bench predict`
(docs/simulator.md), not in timed tests."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fourfold.comm.auto import CostModel, cost
from fourfold.comm.auto import predict as allreduce_time
from fourfold.models import shard_plan
from fourfold.models.gpt import GPTConfig, TinyGPT
from fourfold.parallel.timeline import theory_bubble
from fourfold.plan.calibrate import action_overhead, calibrate
from fourfold.plan.costs import UnitCosts, flop_units, measure_units
from fourfold.plan.estimate import estimate_memory
from fourfold.plan.predict import Candidate, Links, Measured, ModelProfile, predict

CONFIG = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=4, d_model=32)
TINY = CostModel(1e-12, 1e-18, 0.0)  # links that cost (almost) nothing
LINK = CostModel(50e-6, 1e-9, 0.0)


def model():
    return TinyGPT(CONFIG, seed=0, dtype=torch.float32)


def block_costs(n_blocks: int, per_sample: float = 1e-3, opt: float = 0.0) -> UnitCosts:
    """Equal blocks, free ends: every stage of an even cut costs the same."""
    unit = [(0.0, 0.0)] + [(0.0, per_sample)] * n_blocks + [(0.0, 0.0)]
    back = [(0.0, 0.0)] + [(0.0, 2 * per_sample)] * n_blocks + [(0.0, 0.0)]
    return UnitCosts(tuple(unit), tuple(back), opt, "test")


def profile(costs: UnitCosts | None = None) -> ModelProfile:
    m = model()
    return ModelProfile.of(m, list(m.blocks), CONFIG.seq_len, shard_plan(m), costs or block_costs(CONFIG.n_layer))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_bubble_is_the_textbook_one_with_equal_stages_and_free_links(schedule):
    links = Links(TINY, TINY, ranks_per_node=8)
    p = predict(profile(), Candidate(pp=2, schedule=schedule, microbatches=4), links, batch_size=8)
    assert p.bubble == pytest.approx(theory_bubble(schedule, 2, 4), abs=1e-6)
    # 2 samples per micro-batch, 2 blocks per stage: F 4 ms, B 8 ms; (m + p - 1)(F + B)
    assert p.step_s == pytest.approx(5 * 12e-3, rel=1e-6)
    assert p.timeline is not None and p.timeline.makespan == pytest.approx(p.step_s, rel=1e-6)


def test_one_rank_is_forward_plus_backward_plus_optimiser():
    costs = block_costs(CONFIG.n_layer, opt=1e-9)
    prof = profile(costs)
    p = predict(prof, Candidate(), Links(TINY, TINY, ranks_per_node=1), batch_size=4)
    elements = sum(q.numel() for q in prof.model.parameters())
    assert p.step_s == pytest.approx(4 * 4 * 3e-3 + elements * 1e-9, rel=1e-9)
    assert p.bubble == 0 and p.dp_comm_s == 0 and p.tp_comm_s == 0


def test_data_parallel_sync_is_the_ring_cost_of_the_gradients_and_exposed_without_a_free_core():
    prof = profile()
    elements = sum(q.numel() for q in prof.model.parameters())
    ring = allreduce_time(LINK, "ring", elements, 4, 2)
    shared = predict(prof, Candidate(dp=2), Links(LINK, LINK, ranks_per_node=2, cores=2), batch_size=8)
    assert shared.dp_comm_s == pytest.approx(ring, rel=1e-9)
    assert shared.dp_exposed_s == pytest.approx(ring, rel=1e-9)  # 2 ranks on 2 cores: nothing free to overlap
    bucket = 1 << 16  # several buckets: a device each hides all but the last behind backward
    devices = predict(prof, Candidate(dp=2), Links(LINK, LINK, ranks_per_node=2), batch_size=8, bucket_bytes=bucket)
    last = elements * 4 % bucket or bucket
    assert devices.dp_exposed_s == pytest.approx(allreduce_time(LINK, "ring", last // 4, 4, 2), rel=1e-9)
    assert devices.dp_exposed_s < shared.dp_exposed_s
    zero3 = predict(prof, Candidate(dp=2, zero=3), Links(LINK, LINK, ranks_per_node=2, cores=2), batch_size=8)
    assert zero3.dp_comm_s == pytest.approx(1.5 * ring, rel=1e-9)


def test_data_parallel_across_nodes_shares_each_nodes_link_among_its_tp_groups():
    prof = profile()
    elements = sum(q.numel() for q in prof.model.parameters())
    slow = CostModel(50e-6, 8e-9, 0.0)
    one_node = predict(prof, Candidate(dp=2, tp=2), Links(TINY, slow, ranks_per_node=4), batch_size=8).dp_comm_s
    assert one_node < 1e-6  # the dp ring inside a node: its free link
    split = predict(prof, Candidate(dp=2, tp=2), Links(TINY, slow, ranks_per_node=2), batch_size=8).dp_comm_s
    alone = predict(prof, Candidate(dp=2), Links(TINY, slow, ranks_per_node=1), batch_size=8).dp_comm_s
    # each tp rank's half of the gradients crosses the one link its node's 2 tp groups share: 2 x the bandwidth
    # term of half the bytes, i.e. the full bytes' term, plus the same number of alpha steps
    half = sum(q.numel() for q in prof.model.parameters()) // 2  # tp shards most of them; bounds, not equality
    assert split > allreduce_time(slow, "ring", half, 4, 2) * 1.5
    assert alone == pytest.approx(allreduce_time(slow, "ring", elements, 4, 2), rel=1e-9)
    # 2 nodes of 2 dp ranks: the ring's node-crossing hops decide each of its 2(G-1) steps
    four = predict(prof, Candidate(dp=4), Links(TINY, slow, ranks_per_node=2), batch_size=8).dp_comm_s
    assert four == pytest.approx(allreduce_time(slow, "ring", elements, 4, 4), rel=1e-3)


def test_more_ranks_than_cores_queue_for_them():
    prof = profile()
    alone = predict(prof, Candidate(dp=4), Links(TINY, TINY, ranks_per_node=4), batch_size=8)
    shared = predict(prof, Candidate(dp=4), Links(TINY, TINY, ranks_per_node=4, cores=2), batch_size=8)
    assert shared.step_s == pytest.approx(2 * alone.step_s, rel=1e-3)
    slower = predict(prof, Candidate(dp=4), Links(TINY, TINY, ranks_per_node=4, cores=2, oversubscribed=1.5), batch_size=8)
    assert slower.step_s == pytest.approx(3 * alone.step_s, rel=1e-3)


def test_a_pipeline_on_shared_cores_runs_its_stages_faster_in_each_others_bubble():
    # dp2 pp2 on 2 cores: 4 processes, but while one stage waits in the fill or drain the other's 2 copies
    # have the cores to themselves; on one core the step is all the work
    prof = profile()
    layout = Candidate(dp=2, pp=2, schedule="gpipe", microbatches=4)
    devices = predict(prof, layout, Links(TINY, TINY, ranks_per_node=4), batch_size=16)
    two = predict(prof, layout, Links(TINY, TINY, ranks_per_node=4, cores=2), batch_size=16)
    one = predict(prof, layout, Links(TINY, TINY, ranks_per_node=4, cores=1), batch_size=16)
    assert devices.timeline is not None
    work = sum(devices.timeline.busy) * layout.dp  # every process's compute, seconds on a core of its own
    assert one.step_s == pytest.approx(work, rel=1e-6)
    assert work / 2 < two.step_s < 2 * devices.step_s  # not every moment has all 4 computing


def test_a_tensor_parallel_collectives_latency_is_not_slowed_by_shared_cores():
    # tp2 on one core: compute and the bytes copied go at half speed, the collectives' alpha (a wait) does not
    prof, tp2 = profile(), Candidate(tp=2)

    def slowdown(alpha: float) -> float:
        link = CostModel(alpha, 1e-10, 0.0)
        return (predict(prof, tp2, Links(link, link, ranks_per_node=2, cores=1), batch_size=8).step_s
                - predict(prof, tp2, Links(link, link, ranks_per_node=2), batch_size=8).step_s)

    assert slowdown(0.0) > 0
    assert slowdown(1e-3) == pytest.approx(slowdown(0.0), rel=1e-9)


def test_calibrate_takes_the_wake_up_time_of_pipeline_messages_from_a_crowded_pipeline_run():
    prof = profile(block_costs(CONFIG.n_layer, opt=1e-9))
    links = Links(LINK, LINK, ranks_per_node=8, cores=2)
    assert links.wake(2) == 0.0 and replace(links, wake_s=1.0).wake(3) == replace(links, wake_s=1.0).wake(8) == 1.0
    crowded = Candidate(dp=2, pp=2, schedule="1f1b", microbatches=2)
    before = predict(prof, crowded, links, batch_size=8).step_s
    runs = {Candidate(dp=2): Measured(predict(prof, Candidate(dp=2), links, batch_size=8).step_s),
            crowded: Measured(before + 0.05)}
    _, links2, fitted = calibrate(prof, links, 8, runs)
    assert fitted["wake_s"] > 0 and links2.wake_s == fitted["wake_s"]
    assert predict(prof, crowded, links2, batch_size=8).step_s == pytest.approx(before + 0.05, rel=1e-6)
    assert predict(prof, Candidate(pp=2, schedule="1f1b", microbatches=2), links2, batch_size=8).step_s == \
        predict(prof, Candidate(pp=2, schedule="1f1b", microbatches=2), links, batch_size=8).step_s  # 2 ranks: none


def test_a_send_costs_the_actions_that_send_to_another_rank_only():
    # pp2, 2 micro-batches: 1F1B and ZB-H1 send after 2 actions a rank (ZB's W sends nothing); interleaved v2 after 6
    prof, links = profile(), Links(TINY, TINY, ranks_per_node=2)
    sending = replace(links, send_s=1e-3)
    for schedule, virtual, sends in (("1f1b", 1, 2), ("zb", 1, 2), ("interleaved", 2, 6)):
        L = Candidate(pp=2, schedule=schedule, microbatches=2, virtual=virtual)
        grown = predict(prof, L, sending, batch_size=8).compute_s - predict(prof, L, links, batch_size=8).compute_s
        assert grown == pytest.approx(sends * 1e-3, rel=1e-6), schedule


def test_calibrate_takes_an_actions_overhead_and_a_messages_latency_from_a_pipeline_run():
    from fourfold.observe.trace import Span

    ms = 1_000_000

    def span(kind: str, name: str, start: float, end: float, mb: int | None = 0) -> Span:
        return Span(0, kind, name, int(start * ms), int(end * ms), microbatch=mb)

    # a wait, F0 and its send, B0, F1 and its send, a wait, B1, the optimizer (not an action): 1.5 ms after each
    # sending action (a wait left out), 0.5 ms after the one that sends nothing
    row = [span("wait", "wait", 0, 2), span("comm", "recv", 0, 2), span("compute", "F", 2, 5), span("comm", "send", 5, 6),
           span("compute", "B", 6.5, 10.5), span("compute", "F", 11, 14, 1), span("comm", "send", 14, 15, 1),
           span("wait", "wait", 15, 17, 1), span("compute", "B", 17.5, 20, 1), span("compute", "optimizer", 21, 22, None)]
    spans = {0: row, 1: [replace(s, rank=1) for s in row]}
    assert action_overhead(spans) == pytest.approx((0.5e-3, 1e-3))  # bookkeeping an action, and a send beyond it
    assert action_overhead({0: [Span(0, "compute", "forward", 0, ms)]}) == (0.0, 0.0)  # no pipeline actions

    prof = profile(block_costs(CONFIG.n_layer, opt=1e-9))
    links = Links(LINK, LINK, ranks_per_node=8, cores=2)
    pp2 = Candidate(pp=2, schedule="1f1b", microbatches=2)
    before = predict(prof, pp2, links, batch_size=8).step_s
    _, links2, fitted = calibrate(prof, links, 8, {pp2: Measured(before + 0.02, spans)})
    assert links2.action_s == fitted["action_s"] == pytest.approx(0.5e-3)
    assert links2.send_s == fitted["send_s"] == pytest.approx(1e-3)
    assert links2.p2p_alpha_s == fitted["p2p_alpha_s"] > LINK.alpha_s
    assert predict(prof, pp2, links2, batch_size=8).step_s == pytest.approx(before + 0.02, rel=1e-6)
    # twice the actions and more hops a step: interleaved pays more of both than the 1F1B run they were fitted on
    interleaved = Candidate(pp=2, schedule="interleaved", microbatches=2, virtual=2)
    grown = predict(prof, interleaved, links2, batch_size=8).step_s - predict(prof, interleaved, links, 8).step_s
    assert grown > 0.02
    # with a core per rank missing (4 ranks on 2 cores) the run is a crowded one: it fits wake_s, not these
    crowded = Candidate(dp=2, pp=2, schedule="1f1b", microbatches=2)
    assert "p2p_alpha_s" not in calibrate(prof, links, 8, {crowded: Measured(1.0, spans)})[2]


def test_a_messages_latency_is_read_off_the_run_from_its_send_to_the_receive_that_waited_for_it():
    from fourfold.observe.trace import Span
    from fourfold.plan.calibrate import message_latency

    ms = 1_000_000

    def comm(rank: int, name: str, start: float, end: float, mb: int, stage: int, what: str) -> Span:
        return Span(rank, "comm", name, int(start * ms), int(end * ms), bytes=1000 if name == "send" else 0,
                    microbatch=mb, args={"stage": stage, "what": what})

    # activations 0 and 1 go 0 -> 1, waited for from 2 and 6.5 ms; their sends end at 3 and 7 ms: 0.4 and 0.2 ms
    # on the way; activation 2's receive came after its send (nothing waited): no figure. Gradient 0 goes back.
    spans = {0: [comm(0, "send", 2.9, 3.0, 0, 0, "activation"), comm(0, "send", 6.8, 7.0, 1, 0, "activation"),
                 comm(0, "send", 8.0, 8.1, 2, 0, "activation"), comm(0, "recv", 9.0, 12.0, 0, 0, "gradient")],
             1: [comm(1, "recv", 2.0, 3.4, 0, 1, "activation"), comm(1, "recv", 6.5, 7.2, 1, 1, "activation"),
                 comm(1, "recv", 9.0, 9.1, 2, 1, "activation"), comm(1, "send", 11.5, 11.7, 0, 1, "gradient")]}
    latency, nbytes = message_latency(spans)
    assert latency == pytest.approx(0.3e-3) and nbytes == 1000  # the median of 0.4, 0.2 and the gradient's 0.3
    assert message_latency({0: [comm(0, "send", 1, 2, 0, 0, "activation")]}) is None

    prof = profile(block_costs(CONFIG.n_layer, opt=1e-9))
    link = CostModel(1e-3, 1e-8, 0.0)  # 10 ns a byte: 1000 bytes take 0.01 ms of it
    pp2 = Candidate(pp=2, schedule="1f1b", microbatches=2)
    _, links, fitted = calibrate(prof, Links(link, link, ranks_per_node=8, cores=2), 8, {pp2: Measured(1.0, spans)})
    # read off, not fitted to the run's step: a run slow for any other reason (1 s here) leaves it alone
    assert links.p2p_alpha_s == fitted["p2p_alpha_s"] == pytest.approx(0.3e-3 - 1e-5)


def test_a_crowded_machines_gradient_sync_shares_the_cores_but_not_its_latency():
    prof = profile(block_costs(CONFIG.n_layer, opt=1e-9))
    slow = CostModel(1e-3, 1e-8, 0.0)  # 1 ms per ring step, 10 ns per byte
    dp4 = Candidate(dp=4)
    alone = predict(prof, dp4, Links(slow, slow, ranks_per_node=4), batch_size=8)
    crowded = predict(prof, dp4, Links(slow, slow, ranks_per_node=4, cores=2), batch_size=8)
    latency = cost("ring", 1, 4, 4).steps * 1e-3
    # 4 ranks on 2 cores: each copies and adds its bytes at half speed; the 6 ring steps' waits do not slow
    assert crowded.dp_comm_s - latency == pytest.approx(2 * (alone.dp_comm_s - latency), rel=1e-6)
    # across machines the wire, not the cores, carries the bytes
    net = Links(slow, slow, ranks_per_node=2, cores=1)
    assert predict(prof, dp4, net, 8).dp_comm_s == pytest.approx(predict(prof, dp4, replace(net, cores=None), 8)
                                                                 .dp_comm_s, rel=1e-9)


def test_the_predicted_step_as_trace_spans():
    prof = profile(block_costs(CONFIG.n_layer, opt=1e-9))
    links = Links(LINK, LINK, ranks_per_node=4, cores=2)
    p = predict(prof, Candidate(dp=2, pp=2, schedule="1f1b", microbatches=4), links, batch_size=16)
    spans = p.spans(step=3)
    assert sorted(spans) == [0, 1]
    for r, row in spans.items():
        assert [s.name for s in row if s.name in "FB"].count("F") == 4  # one F and one B per micro-batch
        assert row[-1].name == "optimizer" and all(s.step == 3 and s.rank == r for s in row)
        assert all(a.end_ns <= b.start_ns + 1 for a, b in zip(row, row[1:], strict=False))  # one at a time
    assert max(row[-1].end_ns for row in spans.values()) == pytest.approx(p.step_s * 1e9, abs=2)
    one = predict(prof, Candidate(dp=2), links, batch_size=16).spans()
    assert [s.name for s in one[0]] == ["forward", "backward", "grad_sync", "optimizer"]


def test_tensor_parallel_collectives_are_counted_per_layer():
    prof = profile()
    # TinyGPT's plan: a vocabulary-parallel embedding and each block's attn.proj and mlp.proj row-parallel
    # (forward all-reduces); each block's qkv and fc column-parallel and the head (backward all-reduces)
    assert sum(prof.forward_collectives) == 1 + 2 * CONFIG.n_layer
    assert sum(prof.backward_collectives) == 2 * CONFIG.n_layer + 1
    free = predict(prof, Candidate(tp=2), Links(TINY, TINY, ranks_per_node=2), batch_size=8)
    slow = predict(prof, Candidate(tp=2), Links(LINK, LINK, ranks_per_node=2), batch_size=8)
    one = allreduce_time(LINK, "ring", prof.hidden_bytes * 8 // 4, 4, 2)
    assert slow.tp_comm_s == pytest.approx(one * (sum(prof.forward_collectives) + sum(prof.backward_collectives)))
    assert slow.step_s - free.step_s == pytest.approx(slow.tp_comm_s, rel=1e-3)


def test_a_norm_over_split_features_costs_a_small_all_reduce_forward_and_backward():
    """OLMo's q/k norms (plan style "norm"): each all-reduces a float32 per token, forward and backward, beside
    the block's two activation all-reduces each way."""
    pytest.importorskip("transformers")
    from fourfold.models.hf import build_hf, plan

    m = build_hf("olmo2", overrides=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))
    blocks = list(m.model.layers)
    prof = ModelProfile.of(m, blocks, 16, plan(m), block_costs(4))
    assert prof.norm_collectives == (0, 2, 2, 2, 2, 0)  # q_norm and k_norm in each block
    # one f before the attention's q, k, v and one before the MLP's gate, up, as the regions' entries all-reduce
    # (test_your_model checks the run's own); the embedding and the two row layers each forward, the head backward
    assert prof.backward_collectives == (0, 2, 2, 2, 2, 1) and prof.forward_collectives == (1, 2, 2, 2, 2, 0)
    slow = predict(prof, Candidate(tp=2), Links(LINK, LINK, ranks_per_node=2), batch_size=8)
    one = allreduce_time(LINK, "ring", prof.hidden_bytes * 8 // 4, 4, 2)
    statistic = allreduce_time(LINK, "ring", 16 * 8, 4, 2)  # a float32 per token of the 8 x 16
    collectives = sum(prof.forward_collectives) + sum(prof.backward_collectives)
    assert slow.tp_comm_s == pytest.approx(one * collectives + statistic * 2 * 8)


def test_memory_is_the_estimate():
    prof = profile()
    layout = Candidate(dp=2, pp=2, schedule="zb", microbatches=2, zero=1)
    p = predict(prof, layout, Links(TINY, TINY, ranks_per_node=8), batch_size=8)
    m = prof.model
    assert p.memory == estimate_memory(m, list(m.blocks), dp=2, pp=2, batch_size=8, microbatches=2, schedule="zb",
                                       virtual=1, zero=1, shards=shard_plan(m), probe=prof.probe)


def test_accumulation_runs_its_micro_batches_one_after_another_and_holds_one():
    fixed = (1e-4, 2e-3)  # each unit's own time per call, forward and backward (say, a kernel launch)
    costs = UnitCosts(tuple([(fixed[0], 1e-3)] * (CONFIG.n_layer + 2)), tuple([(fixed[1], 2e-3)] * (CONFIG.n_layer + 2)),
                      0.0, "test")
    prof, links = profile(costs), Links(TINY, TINY, ranks_per_node=1)
    one, four = (predict(prof, Candidate(grad_accum=k), links, batch_size=8) for k in (1, 4))
    units = CONFIG.n_layer + 2  # the per-sample work is the same; each extra micro-batch pays the fixed costs again
    assert four.step_s - one.step_s == pytest.approx(3 * units * sum(fixed), rel=1e-9)
    assert str(four.layout) == "dp1 tp1 pp1 accum4" and four.layout.flags()[-2:] == ["--grad-accum", "4"]
    m = prof.model
    assert four.memory == estimate_memory(m, list(m.blocks), batch_size=8, microbatches=4, shards=shard_plan(m),
                                          probe=prof.probe)
    assert four.memory[0].activations < one.memory[0].activations
    with pytest.raises(ValueError, match="1 with a pipeline"):
        predict(prof, Candidate(pp=2, microbatches=2, grad_accum=2), links, batch_size=8)


@pytest.mark.parametrize(("zero", "halves"), [(0, 2), (1, 2), (2, 3), (3, 6)])
def test_accumulations_sync_is_once_a_step_except_zero_2_and_3_which_reduce_scatter_each_micro_batch(zero, halves):
    prof = profile()
    elements = sum(q.numel() for q in prof.model.parameters())
    ring = allreduce_time(LINK, "ring", elements, 4, 2)
    links = Links(LINK, LINK, ranks_per_node=2, cores=2)  # no core free: every sync exposed
    p = predict(prof, Candidate(dp=2, zero=zero, grad_accum=2), links, batch_size=8)
    # in halves of an all-reduce: dp and ZeRO-1 one all-reduce; ZeRO-2 a reduce-scatter per micro-batch and one
    # all-gather; ZeRO-3 a reduce-scatter and two all-gathers per micro-batch
    assert p.dp_comm_s == pytest.approx(halves / 2 * ring, rel=1e-9)
    assert p.dp_exposed_s == pytest.approx(p.dp_comm_s, rel=1e-9)
    for k in (2, 4):  # a device each: what backward cannot hide, never more than the syncs themselves
        free = predict(prof, Candidate(dp=2, zero=zero, grad_accum=k), Links(LINK, LINK, ranks_per_node=2),
                       batch_size=8)
        assert 0 < free.dp_exposed_s <= free.dp_comm_s + 1e-15, (k, free.dp_exposed_s, free.dp_comm_s)


def test_plan_accumulates_where_a_layout_fits_only_so(capsys):
    from fourfold.cli.plan import main
    from fourfold.train import parse_args

    flags = ["--gpus", "2", "--gpu-mem", "2GB", "--n-layer", "4", "--d-model", "512", "--n-head", "8",
             "--vocab-size", "32000", "--seq-len", "1024", "--batch-size", "32"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:2].strip().isdigit() and " ms " in line]
    accumulated = [r for r in rows if any(c.startswith("accum") for c in r[4:6])]
    assert accumulated and all(r[3] == "pp1" for r in accumulated), out  # a pipeline's micro-batches do that job
    cfg = parse_args(_command(out))
    first_k = next((int(c[5:]) for c in rows[0][4:6] if c.startswith("accum")), 1)
    assert cfg.parallel.grad_accum == first_k and cfg.launch.world_size == 2
    assert main(["--gpus", "2", "--gpu-mem", "80GB", *flags[4:]]) == 0  # it all fits: nothing accumulated
    assert " accum" not in capsys.readouterr().out
    assert main([*flags, "--grad-accum", "2"]) == 2
    assert "chooses gradient accumulation itself" in capsys.readouterr().err


def test_a_batch_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="batch_size must divide"):
        predict(profile(), Candidate(dp=2, pp=2, microbatches=4), Links(TINY, TINY, 8), batch_size=12)


def test_measured_units_are_positive_and_grow_with_the_batch():
    m = model()
    costs = measure_units(m, list(m.blocks), CONFIG.seq_len, samples=(1, 8), steps=2)
    n = CONFIG.n_layer + 2
    assert len(costs.forward) == len(costs.backward) == n
    assert all(fixed >= 0 and per >= 0 for fixed, per in (*costs.forward, *costs.backward))
    assert all(costs.time("F", u, 8) > 0 and costs.time("B", u, 8) > 0 for u in range(1, n - 1))
    assert costs.optimizer_s_per_element > 0 and "measured" in costs.source
    assert torch.get_num_threads() >= 1 and all(p.grad is None for p in m.parameters())


def test_flops_on_a_meta_model_match_the_transformer_formula():
    config = GPTConfig(vocab_size=1000, seq_len=128, n_layer=2, n_head=4, d_model=256)
    m = TinyGPT(config, seed=0, dtype=torch.float32, device="meta")
    costs = flop_units(m, list(m.blocks), config.seq_len, flops_per_s=1.0)
    s, d = config.seq_len, config.d_model
    block = 24 * s * d * d + 4 * s * s * d  # qkv, proj, fc, proj; QK^T and AV
    assert costs.forward[1] == (0.0, pytest.approx(block, rel=0.02))
    assert costs.backward[1][1] == pytest.approx(2 * costs.forward[1][1])
    assert costs.forward[-1][1] == pytest.approx(2 * s * d * config.vocab_size, rel=0.05)  # the head


def test_calibrate_takes_contention_from_a_dp_run_and_a_collective_call_from_a_tp_run():
    prof = profile(block_costs(CONFIG.n_layer, opt=1e-9))
    links = Links(LINK, LINK, ranks_per_node=2, cores=2)
    before = predict(prof, Candidate(dp=2), links, batch_size=8)
    work = before.step_s - before.dp_exposed_s
    runs = {Candidate(dp=2): Measured(before.dp_exposed_s + 1.5 * work),
            Candidate(tp=2): Measured(1.0)}
    prof2, links2, fitted = calibrate(prof, links, 8, runs)
    assert fitted["contention"] == pytest.approx(1.5) and links2.contention == fitted["contention"]
    fitted_dp = replace(links, contention=links2.contention)
    for fit in (fitted_dp, links2):  # the tp fit leaves the links' alpha, so the dp run still comes out
        assert predict(prof2, Candidate(dp=2), fit, batch_size=8).step_s == pytest.approx(runs[Candidate(dp=2)].step_s,
                                                                                    rel=1e-9)
    assert links2.node == LINK and links2.tp_call_s == fitted["tp_call_s"] > 0
    assert predict(prof2, Candidate(tp=2), links2, batch_size=8).step_s == pytest.approx(1.0, rel=1e-9)
    # a call, not a ring step: sequence parallelism's reduce-scatter and all-gather halves cost one each, so its
    # step is longer by a call per extra collective (TinyGPT: every region's f and g, both ways)
    sp = Candidate(tp=2, sequence_parallel=True)
    calls = sum(prof.forward_collectives) + sum(prof.backward_collectives)
    assert predict(prof2, sp, links2, 8).step_s - predict(prof2, Candidate(tp=2), links2, 8).step_s == pytest.approx(
        calls * links2.tp_call_s, rel=1e-6)
    assert predict(prof2, sp, links, 8).step_s == pytest.approx(predict(prof2, Candidate(tp=2), links, 8).step_s)
    # a pipeline stage computing alone (the other waits in the bubble) goes at its own speed: GPipe pp2 comes out
    # between no contention and contention over the whole step
    gpipe = Candidate(pp=2, schedule="gpipe", microbatches=2)
    all_along = predict(replace(prof, costs=prof.costs.scaled(1.5, "all along")), gpipe, links, 8).step_s
    assert predict(prof, gpipe, links, 8).step_s < predict(prof, gpipe, fitted_dp, 8).step_s < all_along


def test_layouts_respect_heads_blocks_batch_and_machines():
    from fourfold.plan.layouts import layouts

    all_ = layouts(8, 4, 16, heads=4, tensor_plan=True, per_node=8)
    assert {(L.dp, L.tp, L.pp) for L in all_} >= {(8, 1, 1), (4, 2, 1), (2, 2, 2), (1, 2, 4), (2, 4, 1)}
    assert all(L.pp <= 4 and L.pp * L.virtual <= 4 and 16 % (L.dp * L.microbatches) == 0 for L in all_)
    assert not any(L.tp == 8 for L in all_)  # 8 does not divide... 4 heads
    assert not any(L.tp > 2 for L in layouts(8, 4, 16, heads=4, tensor_plan=True, per_node=2))
    assert all(L.tp == 1 for L in layouts(8, 4, 16, heads=4, tensor_plan=False, per_node=8))
    assert all(L.zero == 0 for L in all_ if L.dp == 1)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_plan_ranks_a_hugging_face_model_on_paper(capsys, family):
    # built on the meta device, where transformers' causal mask would read values: given as a 4-D mask
    pytest.importorskip("transformers")
    from pathlib import Path

    from fourfold.cli.plan import main

    config = Path(__file__).resolve().parent.parent / "examples" / f"{family}-tiny.json"
    assert main(["--gpus", "8", "--model", family, "--model-config", str(config), "--seq-len", "16",
                 "--batch-size", "16", "--top", "2"]) == 0
    assert f"--model {family} --model-config {config}" in capsys.readouterr().out  # the command, as given


def test_plan_ranks_layouts_of_a_model_this_machine_cannot_hold(capsys):
    from fourfold.cli.plan import main

    flags = ["--gpus", "16", "--gpu-mem", "80GB", "--link", "400gbit", "--n-layer", "8", "--d-model", "4096",
             "--n-head", "32", "--vocab-size", "50257", "--seq-len", "2048", "--batch-size", "64", "--top", "5"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    assert "(1,825.3 M parameters)" in out  # built on the meta device: nothing allocated
    rows = [line.split() for line in out.splitlines() if line.strip()[:2].strip().isdigit() and " ms " in line]
    assert len(rows) == 5  # 16 GPUs at 8 a machine: the command for each of the 2 machines
    assert "fourfold train --nnodes 2 --node-rank K --rdzv-endpoint HOST:PORT --nproc 8 --dp " in out, out
    # fourfold train refuses tp > 1 for a vocabulary of 50257 (odd): those layouts are left out, and said so
    assert all(r[2] == "tp1" for r in rows), rows
    assert "left out: " in out and "vocab_size must be divisible by tp, got vocab_size=50257" in out
    steps = [float(r[r.index("ms") - 1]) for r in rows]
    assert steps == sorted(steps)  # fastest first
    assert main([*flags[:2], "--gpu-mem", "1GB", *flags[4:]]) == 1
    assert "none fits" in capsys.readouterr().out


def test_plan_refuses_bad_flags(capsys):
    from fourfold.cli.plan import main

    assert main(["--gpus", "0"]) == 2
    assert "--gpus" in capsys.readouterr().err
    assert main(["--gpus", "8", "--link", "fast"]) == 2
    assert "link must be a rate" in capsys.readouterr().err
    assert main(["--memory", "--gpus", "64", "--nproc", "2"]) == 2  # two modes: one layout's memory, or the ranking
    assert "error: --memory prints one layout's memory on --nproc ranks here, and --gpus belongs to ranking" in \
        capsys.readouterr().err
    assert main(["--nproc", "2", "--link", "1gbit"]) == 2  # read on paper or in a lab, not here: not ignored
    assert "--link is the link between machines on paper (--gpus N) or between a lab's nodes (--lab N), got it " \
           "with neither" in capsys.readouterr().err
    assert main(["--nproc", "2", "--gpu-mem", "80GB", "--mfu", "0.5"]) == 2
    assert "--gpu-mem, --mfu describe the devices of a plan on paper, got them without --gpus" in \
        capsys.readouterr().err


def test_plan_refuses_to_time_here_a_model_this_machine_cannot_hold_whole(capsys, monkeypatch):
    """Timing units builds the whole model in the plan's own process: a 6.7 B-parameter Llama (its config class's
    default) on a machine with 8 GB is refused, counted on the meta device, instead of being killed as it is
    built."""
    pytest.importorskip("transformers")
    from fourfold.cli.plan import main
    from fourfold.plan import estimate

    monkeypatch.setattr(estimate, "per_rank_memory", lambda world_size, device="cpu": (8 * 2**30, "test"))
    assert main(["--nproc", "2", "--model", "llama", "--batch-size", "8"]) == 2
    assert "timing the model's units here trains it whole in this process, got 25.1 GB of parameters (with " \
           "gradients and AdamW's two moments, about 126 GB) against the 8 GB this machine has available. Plan it on " \
           "paper" in capsys.readouterr().err


SMALL = ["--n-layer", "2", "--d-model", "64", "--n-head", "2", "--seq-len", "32", "--batch-size", "8"]


def _error(capsys) -> str:
    """stderr's one line (a refusal is one line, never a usage block or a traceback)."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fourfold plan: error: "), err
    return err


def test_plan_refuses_gpus_that_whole_machines_cannot_make_up(capsys):
    from fourfold.cli.plan import main

    assert main(["--gpus", "8", "--gpus-per-node", "3", *SMALL]) == 2  # was: --nnodes 3 --nproc 3, 9 processes
    assert "--gpus 8 must be a multiple of --gpus-per-node 3 (every machine runs --nproc 3 ranks), got 8 = 2 x 3 + " \
           "2. Pass --gpus 6 or 9, or a --gpus-per-node that divides 8 (2, 4 or 8)." in _error(capsys)
    assert main(["--gpus", "6", "--gpus-per-node", "3", *SMALL[:-1], "12"]) == 0  # 2 machines of 3
    assert "--nnodes 2 --node-rank K --rdzv-endpoint HOST:PORT --nproc 3 " in capsys.readouterr().out
    assert main(["--gpus", "4", "--gpus-per-node", "8", *SMALL]) == 0  # fewer than a machine holds: one machine


def test_plan_says_why_no_layout_can_run_and_what_would(capsys):
    from fourfold.cli.plan import main

    assert main(["--gpus", "7", *SMALL]) == 2  # was: "0 layouts considered, 0 fit" and an empty table
    err = _error(capsys)
    assert "no layout of 7 GPUs can run this model and batch 8: " in err
    assert "dp7 tp1 pp1: batch 8 does not divide by dp 7" in err and "dp1 tp7 pp1: its 2 heads do not divide" in err
    assert "dp1 tp1 pp7: 2 block(s) do not make 7 stages" in err
    assert err.rstrip().endswith("Pass --batch-size 14, or --gpus 4 or 8."), err
    batch = SMALL[:-1] + ["14"]
    assert main(["--gpus", "7", *batch]) == 0 and main(["--gpus", "4", *SMALL]) == 0  # the fixes it names work
    assert main(["--gpus", "8", *SMALL]) == 0
    assert main(["--gpus", "8", "--data", "no/such/file"]) == 2  # every split refused by train: train's reason
    assert "refused by fourfold train (data must be a readable file or folder, got 'no/such/file'" in _error(capsys)


def test_plan_says_a_bps_link_in_bits(capsys):
    from fourfold.cli.plan import main

    assert main(["--gpus", "8", "--link", "1Gbps", "--top", "1", *SMALL]) == 0  # tc's units: bytes per second
    assert "links: 1Gbps (8 Gbit/s: tc's bps is bytes per second), 10 us" in capsys.readouterr().out
    assert main(["--gpus", "8", "--link", "400gbit", "--node-link", "900GBps", "--top", "1", *SMALL]) == 0
    assert "links: 400gbit, 10 us between machines, 900GBps (7.2 Tbit/s: tc's bps is bytes per second), 10 us " \
           "within one" in capsys.readouterr().out


def test_plan_refuses_a_gpu_memory_without_its_unit(capsys):
    from fourfold.cli.plan import main

    assert main(["--gpus", "8", "--gpu-mem", "80", *SMALL]) == 2  # was: 80 bytes, "none fits"
    assert "--gpu-mem must have a unit, got '80', which would be 80 bytes. Pass 80GB" in _error(capsys)
    assert main(["--gpus", "8", "--gpu-mem", "-5GB", *SMALL]) == 2  # not argparse's "expected one argument"
    assert "--gpu-mem must be a number with a unit B, KB, MB, GB or TB, like 80GB or 512MB, got '-5GB'." in \
        _error(capsys)
    assert main(["--gpus", "8", "--gpu-mem", "0GB", *SMALL]) == 2
    assert "--gpu-mem must be more than 0 bytes, got '0GB'" in _error(capsys)
    assert main(["--gpus", "8", "--gpu-mem", "80GB", "--top", "1", *SMALL]) == 0
    assert "80 GB per rank (--gpu-mem)" in capsys.readouterr().out


def _command(out: str) -> list[str]:
    """The suggested ``fourfold train`` command's flags, K and HOST:PORT filled in as a user would."""
    import shlex

    line = next(line for line in out.splitlines() if "run the first" in line)
    flags = shlex.split(line.split("fourfold train", 1)[1])
    return ["0" if f == "K" else "10.0.0.1:29400" if f == "HOST:PORT" else f for f in flags]


def test_plan_prints_a_command_that_runs_the_model_and_batch_planned(capsys):
    from fourfold.cli.plan import main
    from fourfold.train import parse_args

    user = ["--dp", "3", "--zero", "1", "--lr", "0.01", *SMALL]  # the layout's flags replace the user's own
    assert main(["--gpus", "16", "--gpus-per-node", "4", "--top", "1", *user]) == 0
    out = capsys.readouterr().out
    assert "..." not in out
    flags = _command(out)
    cfg = parse_args(flags)
    first = next(line for line in out.splitlines() if line.strip().startswith("1 ")).split()
    assert (f"dp{cfg.parallel.dp}", f"tp{cfg.parallel.tp}", f"pp{cfg.parallel.pp}") == tuple(first[1:4])
    assert cfg.launch.nnodes * cfg.launch.nproc == 16 and cfg.launch.nproc == 4
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head, cfg.model.seq_len, cfg.train.batch_size,
            cfg.optim.lr) == (2, 64, 2, 32, 8, 0.01)
    assert flags.count("--dp") == 1 and flags.count("--zero") <= 1
    assert main(["--gpus", "4", "--top", "1", *SMALL]) == 0  # one machine: run here
    cfg = parse_args(_command(capsys.readouterr().out))
    assert cfg.launch.world_size == 4 and cfg.train.batch_size == 8 and cfg.model.n_layer == 2


def test_plan_stops_quietly_when_its_reader_goes(capsys, monkeypatch):
    """``fourfold plan ... | head``: the pipe closes before the table is written; no BrokenPipeError traceback."""
    import os
    import sys

    from fourfold.cli.plan import main

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    stdout = open(write, "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["--gpus", "8", *SMALL]) == 141  # as a process stopped by SIGPIPE
    monkeypatch.undo()
    stdout.close()  # what was left in the buffer goes to /dev/null now: no second BrokenPipeError
    assert capsys.readouterr().err == ""


def test_plan_says_uncalibrated_figures_for_more_ranks_than_cores_are_optimistic(capsys, monkeypatch):
    from fourfold.cli import plan

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    small = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "8", "--top", "2"]
    assert plan.main([*small, "--nproc", "4"]) == 0
    out = capsys.readouterr().out
    assert "(0.03 M parameters)" in out and "note: 4 ranks share this machine's 2 CPU cores" in out, out
    assert plan.main([*small, "--nproc", "2"]) == 0
    assert "note:" not in capsys.readouterr().out


def test_plan_calibrates_on_the_runs_this_model_and_batch_can_make(capsys, monkeypatch):
    from fourfold.cli.plan import main
    from fourfold.plan import runs

    made = []

    def fake_run(layout, steps, train_flags, timeout, lab=None):  # the real one: the next test
        made.append(layout)
        return Measured(0.2 * layout.world_size + 0.01 * len(made), stolen=0.0)  # later runs slower

    monkeypatch.setattr(runs, "measure_run", fake_run)
    flags = ["--nproc", "4", "--batch-size", "6", "--n-layer", "2", "--d-model", "32", "--n-head", "2",
             "--seq-len", "16", "--top", "3"]
    assert main([*flags, "--calibrate"]) == 0
    out = capsys.readouterr().out
    once = [Candidate(dp=2), Candidate(tp=2), Candidate(pp=2, schedule="1f1b", microbatches=1),
            Candidate(dp=2, pp=2, schedule="1f1b", microbatches=1)]
    assert made == once + once[::-1]  # the fastest of 2 each, in rotation (a drifting machine weighs on all)
    assert "calibration layout dp4 tp1 pp1: skipped (batch 6 does not divide by dp 4)" in out
    assert "calibration run 4/8, dp2 tp1 pp2 1f1b m1: 840.0 ms per step, 0% of the CPU stolen" in out
    assert "calibration run 8/8, dp2 tp1 pp1: 480.0 ms per step" in out
    assert "fitted: " in out and "wake_s" in out and "contention" in out and "p2p_alpha_s" in out
    assert "the fastest of 2 timings" in out  # the units timed again between the rounds of runs
    assert main(["--gpus", "8", "--calibrate"]) == 2
    assert "with --gpus (on paper) there is nothing to run" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_calibration_run_is_a_real_run_whose_layout_flags_win():
    from fourfold.plan.runs import measure_run

    user = ["--nproc", "4", "--dp", "4", "--zero", "2", "--n-layer", "2", "--d-model", "32", "--n-head", "2",
            "--seq-len", "16", "--batch-size", "4", "--no-progress"]
    m = measure_run(Candidate(dp=2), 3, user, timeout=150)
    assert sorted(m.spans) == [0, 1] and m.step_s > 0  # 2 ranks, not the user's 4
    assert {"forward", "backward", "optimizer"} <= {s.name for s in m.spans[0]}
    assert m.stolen is None or 0 <= m.stolen <= 1


def test_bench_predict_layout_names():
    from fourfold.bench.predict import parse_layout

    assert parse_layout("dp2tp2pp2:zb", 4) == Candidate(2, 2, 2, "zb", 4, 1)
    assert parse_layout("pp2:interleaved", 4) == Candidate(1, 1, 2, "interleaved", 4, 2)
    assert parse_layout("tp2", 4) == Candidate(tp=2)
    assert parse_layout("dp2:accum4", 4) == Candidate(dp=2, grad_accum=4)
    assert parse_layout("tp2pp2:zb:sp", 4) == Candidate(1, 2, 2, "zb", 4, 1, sequence_parallel=True)
    for bad in ("dp2:zb2", "pp2:1f1b:accum2", "dp2:sp", "tp1:sp"):
        with pytest.raises(ValueError, match="layout must look like"):
            parse_layout(bad, 4)


def test_bench_predict_counts_the_pairs_its_ranking_swaps_and_whether_the_runs_can_tell():
    from fourfold.bench.predict import swapped_pairs

    def row(name, predicted, measured, spread=1.05):
        return {"layout": name, "predicted_s": predicted, "measured_s": measured, "spread": spread}

    rows = [row("a", 1.0, 1.0), row("b", 2.0, 3.0), row("c", 3.0, 2.0), row("d", 4.0, 2.9, spread=1.2)]
    beyond, within = swapped_pairs(rows)
    assert beyond == [("b", "c")]  # 3.0 vs 2.0 measured: 1.5x apart, beyond either run's 1.05x spread
    assert within == [("b", "d")]  # 3.0 vs 2.9: closer than d's own runs were to each other
    assert swapped_pairs([row("a", 1.0, 1.0), row("b", 2.0, 2.0)]) == ([], [])


def test_bench_predict_draws_each_layouts_measured_step_beside_the_predicted_one(tmp_path):
    import json

    from fourfold.bench.predict import _side_by_side
    from fourfold.observe.trace import Span

    layout = Candidate(dp=2, pp=2, schedule="1f1b", microbatches=4)
    p = predict(profile(block_costs(CONFIG.n_layer, opt=1e-9)), layout, Links(LINK, LINK, ranks_per_node=4),
                batch_size=16)
    spans = {r: [Span(r, "compute", "F", 0, 10**6, microbatch=0, step=7)] for r in range(4)}
    _side_by_side(layout, Measured(0.2, spans), p, tmp_path)
    trace = json.loads((tmp_path / "dp2-tp1-pp2-1f1b-m4.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert {"rank 0: stage 0 dp 0 measured", "rank 4: stage 0 predicted", "rank 5: stage 1 predicted"} <= names
    predicted = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["pid"] == 5]  # rank 4
    assert sum(e["name"] == "F" for e in predicted) == 4 and predicted[-1]["name"] == "optimizer"
    assert (tmp_path / "dp2-tp1-pp2-1f1b-m4.png").stat().st_size > 0


def test_bench_predict_replays_saved_measurements_without_running_anything(tmp_path, monkeypatch, capsys):
    import json

    from fourfold.bench.predict import _measurements, _replayed, main
    from fourfold.observe.trace import Span
    from fourfold.plan import runs
    from fourfold.plan.runs import calibration_layouts

    def no_run(*args, **kwargs):
        raise AssertionError("a replay runs nothing")

    monkeypatch.setattr(runs, "measure_run", no_run)
    costs = replace(block_costs(CONFIG.n_layer, opt=1e-9), split_fit=((1e-3, 2e-3), (1e-3, 1e-3), (5e-4, 1e-3)))
    links = Links(LINK, LINK, ranks_per_node=64, cores=2)
    checked = [Candidate(pp=2, schedule="gpipe", microbatches=2), Candidate(dp=2, tp=2)]
    spans = {0: [Span(0, "compute", "F", 0, 10**6, microbatch=0, step=3)]}
    measured = {L: (Measured(0.05 * L.world_size, spans, 0.0), 1.1) for L in [*calibration_layouts(2), *checked]}
    saved = _measurements(costs, links, measured)
    assert _replayed(json.loads(json.dumps(saved))) == (costs, links, measured)  # through JSON and back, equal
    older = json.loads(json.dumps(saved))  # a figure the model has since dropped, one it has since gained
    older["links"]["retired_s"] = 1.0
    del older["links"]["send_s"], older["costs"]["split_fit"]
    assert _replayed(older)[:2] == (replace(costs, split_fit=None), links)
    saved["settings"] = {"n_layer": CONFIG.n_layer, "d_model": 32, "seq_len": 16, "batch_size": 8,
                         "microbatches": 2, "layouts": [{"dp": 1, "tp": 1, "pp": 2, "schedule": "gpipe",
                                                         "microbatches": 2, "virtual": 1, "zero": 0},
                                                        {"dp": 2, "tp": 2, "pp": 1, "schedule": "1f1b",
                                                         "microbatches": 1, "virtual": 1, "zero": 0}]}
    (tmp_path / "old.json").write_text(json.dumps({"measurements": saved}))
    assert main(["--replay", str(tmp_path / "old.json"), "--out", str(tmp_path / "new")]) == 0
    report = json.loads((tmp_path / "new" / "bench.json").read_text())
    assert [r["layout"] for r in report["rows"]] == [str(L) for L in checked]
    assert [r["measured_s"] for r in report["rows"]] == [0.1, 0.2] and "contention" in report["fitted"]
    assert report["measurements"]["runs"] == saved["runs"]  # replayable again
    with pytest.raises(SystemExit):  # a bench.json without measurements is refused by name
        (tmp_path / "bare.json").write_text(json.dumps({"rows": []}))
        main(["--replay", str(tmp_path / "bare.json"), "--out", str(tmp_path / "x")])
    assert "--replay must name the bench.json of a `fourfold bench predict` run" in capsys.readouterr().err


def test_a_split_backward_costs_what_the_units_say():
    # zero-bubble's B and W as measured shares of the fused backward: each rank's busy time follows them
    layout = Candidate(pp=2, schedule="zb", microbatches=4)
    links = Links(TINY, TINY, ranks_per_node=2)
    halves = predict(profile(block_costs(CONFIG.n_layer)), layout, links, batch_size=8)
    costs = block_costs(CONFIG.n_layer)
    slow = predict(profile(UnitCosts(costs.forward, costs.backward, 0.0, "test", split=(1.0, 1.0))), layout, links,
                   batch_size=8)
    # 2 samples per micro-batch, 2 blocks per stage: F 4 ms, fused B 8 ms; 4 micro-batches per rank
    assert halves.compute_s == pytest.approx(4 * (4e-3 + 8e-3), rel=1e-6)
    assert slow.compute_s == pytest.approx(4 * (4e-3 + 16e-3), rel=1e-6)
    m = model()
    measured = measure_units(m, list(m.blocks), CONFIG.seq_len, samples=(1, 2), steps=1)
    assert all(0 < share for share in measured.split) and "split backward" in measured.source
    assert measured.split_fit is not None and measured.split_at(2) == pytest.approx(measured.split, rel=1e-9)


def test_a_fit_of_two_batch_sizes_passes_through_the_larger_ones_time_even_on_a_busy_machine():
    from fourfold.plan.costs import _fit

    assert _fit({1: [3e-3], 2: [5e-3]}) == pytest.approx((1e-3, 2e-3))  # fixed 1 ms + 2 ms a sample
    assert _fit({1: [3e-3], 4: [2e-3]}) == pytest.approx((2e-3, 0.0))  # the larger batch timed faster: flat
    # timed more than twice as slow at twice the samples (a busy machine): the fixed part would be negative;
    # through the origin and the larger batch, whose time the split's shares are read at
    assert _fit({1: [1e-3], 2: [5e-3]}) == pytest.approx((0.0, 2.5e-3))


def test_a_split_backwards_overhead_is_per_call_so_its_share_shrinks_as_micro_batches_grow():
    # fused 1 ms + 2 ms a sample; B and W 1 ms + 1 ms a sample each: 4/3 of fused at one sample, towards 1 at many
    costs = replace(block_costs(CONFIG.n_layer), split=(0.5, 0.5),
                    split_fit=((1e-3, 2e-3), (1e-3, 1e-3), (1e-3, 1e-3)))
    assert costs.split_at(1) == pytest.approx((2 / 3, 2 / 3))
    assert costs.split_at(1000) == pytest.approx((0.5, 0.5), rel=1e-3)
    assert costs.split_at(4, tp=2) == pytest.approx(costs.split_at(2))  # a tensor-parallel rank's share of samples
    assert replace(costs, split_fit=None).split_at(1) == (0.5, 0.5)  # flop_units, or one sample count timed
    layout, links = Candidate(pp=2, schedule="zb", microbatches=2), Links(TINY, TINY, ranks_per_node=2)
    small, large = (predict(profile(costs), layout, links, batch_size=b) for b in (2, 64))
    fused = (predict(profile(costs), replace(layout, schedule="1f1b"), links, batch_size=b) for b in (2, 64))
    # B + W over the fused backward: 4/3 at one sample a micro-batch, close to 1 at 32
    assert [z.compute_s / f.compute_s for z, f in zip((small, large), fused, strict=True)] == pytest.approx(
        [(1 + 4 / 3 * 2) / 3, 1.0], rel=0.02)


def test_calibrate_takes_the_links_beta_from_a_dp_runs_wait_for_its_gradients():
    from fourfold.observe.trace import Span

    prof = profile(block_costs(CONFIG.n_layer, opt=1e-9))
    links = Links(LINK, LINK, ranks_per_node=2, cores=2)
    before = predict(prof, Candidate(dp=2), links, batch_size=8)
    wait = 3 * before.dp_exposed_s
    spans = {r: [Span(r, "wait", "grad_sync", 0, round(wait * 1e9))] for r in range(2)}
    _, links2, fitted = calibrate(prof, links, 8, {Candidate(dp=2): Measured(before.step_s + wait, spans)})
    assert fitted["dp_beta_s_per_byte"] > LINK.beta_s_per_byte
    assert predict(prof, Candidate(dp=2), links2, batch_size=8).dp_exposed_s == pytest.approx(wait, rel=1e-6)


def test_bench_predict_reports_the_cpu_time_the_hypervisor_stole():
    from fourfold.plan.runs import cpu_times, stolen

    assert stolen([0] * 8, [10, 0, 0, 80, 0, 0, 0, 10]) == pytest.approx(0.1)
    assert stolen(None, [1] * 8) is None and stolen([0] * 8, [0] * 8) is None
    now = cpu_times()
    assert now is None or (len(now) == 8 and all(v >= 0 for v in now))


def test_the_fastest_timing_of_the_units_is_the_one_set_beside_the_fastest_runs():
    from fourfold.plan.costs import fastest

    quick, slow = block_costs(CONFIG.n_layer, per_sample=1e-3), block_costs(CONFIG.n_layer, per_sample=1.5e-3)
    assert fastest([quick], 2) is quick
    chosen = fastest([slow, quick, slow], 2)
    assert chosen.forward == quick.forward and chosen.backward == quick.backward
    assert "the fastest of 3 timings (the slowest 1.50x)" in chosen.source
    with pytest.raises(ValueError, match="at least one timing"):
        fastest([], 2)


def test_the_units_are_timed_before_each_round_of_runs_and_the_fastest_kept(monkeypatch):
    from fourfold.plan import runs

    order = []
    monkeypatch.setattr(runs, "measure_run", lambda L, *a, **k: order.append(L) or Measured(0.1, stolen=0.0))
    speeds = iter([1.5e-3, 1e-3, 2e-3])

    def time_units():
        order.append("units")
        return block_costs(CONFIG.n_layer, per_sample=next(speeds))

    a, b = Candidate(dp=2), Candidate(tp=2)
    best, costs = runs.best_runs_and_units([a, b], 3, 3, [], time_units, 2)
    assert order == ["units", a, b, "units", b, a, "units", a, b] and set(best) == {a, b}
    assert costs.forward == block_costs(CONFIG.n_layer, per_sample=1e-3).forward
    assert "the fastest of 3 timings" in costs.source
    order.clear()  # a timing already made stands for the first round's
    _, costs = runs.best_runs_and_units([a], 2, 3, [], lambda: block_costs(CONFIG.n_layer, per_sample=5e-3), 2,
                                        timed=[block_costs(CONFIG.n_layer, per_sample=4e-3)])
    assert order == [a, a] and costs.forward == block_costs(CONFIG.n_layer, per_sample=4e-3).forward
    assert "the fastest of 2 timings" in costs.source  # the given one and the second round's


def test_runs_rotate_so_a_drifting_machine_weighs_on_every_layout(monkeypatch):
    from fourfold.plan import runs

    order, slower = [], iter(range(1, 100))

    def fake_run(layout, steps, train_flags, timeout, lab=None):  # the machine gets slower with every run
        order.append(layout)
        return Measured(0.1 * next(slower), stolen=0.0)

    monkeypatch.setattr(runs, "measure_run", fake_run)
    a, b, c = Candidate(dp=2), Candidate(tp=2), Candidate(dp=4)
    seen = []
    got = runs.best_runs([a, b, c], repeats=2, steps=3, train_flags=[], progress=lambda L, m: seen.append(L),
                         before_round=lambda k: order.append(f"round {k}"))
    assert order == ["round 0", a, b, c, "round 1", c, b, a] and seen == [a, b, c, c, b, a]
    assert {L: round(m.step_s, 3) for L, (m, _) in got.items()} == {a: 0.1, b: 0.2, c: 0.3}
    assert {L: round(spread, 3) for L, (_, spread) in got.items()} == {a: 6.0, b: 2.5, c: 1.333}


def _first_step_ms(out: str) -> float:
    import re

    return float(re.search(r"^\s+1 \S+ .*?(\d+\.\d) ms", out, re.MULTILINE).group(1))


def test_plan_for_a_lab_joins_its_nodes_by_the_labs_link(capsys, monkeypatch, tmp_path):
    from fourfold.cli.plan import main
    from fourfold.comm.auto import CostModel
    from fourfold.lab.net import cost_model_path

    monkeypatch.setenv("HOME", str(tmp_path))  # no lab fitted yet
    flags = ["--nproc", "4", "--batch-size", "8", "--n-layer", "2", "--d-model", "32", "--n-head", "2",
             "--seq-len", "16", "--top", "3"]
    assert main(flags) == 0
    here = capsys.readouterr().out
    assert main([*flags, "--lab", "2", "--link", "1mbit"]) == 0
    lab = capsys.readouterr().out
    assert "links: lab 1mbit, not fitted (fit it: fourfold lab run --nodes 2 --gpus-per-node 2 --link 1mbit" in lab
    assert "run the first in the lab: fourfold lab run --nodes 2 --gpus-per-node 2 --link 1mbit --tcp auto -- " \
           "fourfold train --dp" in lab and "--nproc" not in lab.splitlines()[-1]
    # 1 Mbit/s between the nodes: far above the noise of the units timed here (here 3.9-6.7 ms, the lab 38 ms;
    # at 10 Mbit/s the lab's 8.5 ms came within 1.5x of a slow moment here)
    assert _first_step_ms(lab) > 1.5 * _first_step_ms(here), (here, lab)
    path = cost_model_path(2, 2, "1mbit")  # what lab run's bench allreduce saves: the node link, then the network
    path.parent.mkdir(parents=True)
    CostModel(1e-4, 1e-10, 0.0, "test", network=(3e-4, 8 / 1e6)).save(path)
    assert main([*flags, "--lab", "2", "--link", "1mbit"]) == 0
    assert f"links: lab 1mbit, fitted ({path})" in capsys.readouterr().out
    assert main([*flags, "--lab", "3"]) == 2
    assert "--lab must be a number of nodes that divides --nproc, got --lab 3 for --nproc 4" in capsys.readouterr().err
    assert main(["--gpus", "8", "--lab", "2"]) == 2
    assert "drop one of them" in capsys.readouterr().err


def test_runs_in_a_lab_go_through_lab_run_with_a_nodes_ranks(capsys):
    from fourfold.bench.predict import main
    from fourfold.plan.runs import LabShape

    shape = LabShape(2, "250mbit")
    assert shape.command(Candidate(dp=2, pp=2, schedule="1f1b", microbatches=2)) == [
        "lab", "run", "--nodes", "2", "--gpus-per-node", "2", "--link", "250mbit", "--tcp", "auto", "--",
        "fourfold", "train"]
    with pytest.raises(ValueError, match="cannot run dp3 tp1 pp1 .3 ranks.. Pick layouts of a multiple of 2"):
        shape.command(Candidate(dp=3))
    with pytest.raises(SystemExit):  # refused before any run
        main(["--lab-link", "250mbit", "--layouts", "dp3", "--batch-size", "12"])
    assert "cannot run dp3" in capsys.readouterr().err


def test_a_tensor_parallel_layout_that_fits_only_with_sequence_parallelism_is_ranked_with_it():
    """The planner tries --sequence-parallel on a tp layout that does not fit (the model must run it): the norms
    and residuals split by tp fit it, and its command says so; a model that cannot is left without."""
    from fourfold.plan.layouts import rank_layouts

    prof, links = profile(), Links(TINY, TINY, ranks_per_node=2)
    tp2 = Candidate(tp=2)
    plain, split = (predict(prof, replace(tp2, sequence_parallel=sp), links, 8) for sp in (False, True))
    assert split.peak_bytes < plain.peak_bytes and str(split.layout) == "dp1 tp2 pp1 sp"
    between = (plain.peak_bytes + split.peak_bytes) // 2
    (p, fits), = rank_layouts(prof, [tp2], links, 8, between, sequence_parallel=True)
    assert fits and p.layout.sequence_parallel and "--sequence-parallel" in p.layout.flags()
    (p, fits), = rank_layouts(prof, [tp2], links, 8, between)
    assert not p.layout.sequence_parallel and p.layout.grad_accum > 1  # accumulation instead, if any fits


def test_the_suggested_command_sets_sequence_parallelism_by_its_layout_not_by_the_flags_given():
    """Given --sequence-parallel (or a --config file), the command for a layout without tp must not carry it:
    train refuses sequence parallelism at tp 1. The layout's own flags say when it is on."""
    from fourfold.cli.ranking import _user_flags

    assert _user_flags(["--sequence-parallel", "--model", "gpt2"], Candidate(dp=2)) == ["--model", "gpt2"]
    assert _user_flags(["--config", "run.toml"], Candidate(dp=2, zero=1)) == ["--config", "run.toml",
                                                                           "--no-sequence-parallel", "--cp", "1"]
    assert _user_flags(["--cp", "2", "--model", "gpt2"], Candidate(dp=2)) == ["--model", "gpt2"]  # the plan's --cp
    assert Candidate(tp=2, sequence_parallel=True).flags()[-1] == "--sequence-parallel"


def test_plan_shows_a_tiny_models_step_in_microseconds_not_zero_ms():
    from fourfold.cli.ranking import _time

    assert [_time(s) for s in (47.7e-6, 0.0, 0.0123, 12.0)] == ["47.7 us", "0.0 ms", "12.3 ms", "12.0 s"]


def test_context_parallelism_splits_the_compute_and_the_activations_and_waits_for_attention():
    from fourfold.parallel.context.auto import predict as cp_wire
    from fourfold.plan.layouts import layouts

    prof = profile()
    free = Links(TINY, TINY, ranks_per_node=8)
    one = predict(prof, Candidate(dp=1), free, batch_size=4)
    cp2 = predict(prof, Candidate(cp=2), free, batch_size=4)
    assert cp2.compute_s == pytest.approx(one.compute_s / 2, rel=1e-6)  # half of each sample's tokens per rank
    assert cp2.memory[0].activations == pytest.approx(one.memory[0].activations / 2, rel=0.02)
    slow = Links(LINK, LINK, ranks_per_node=8)
    waited = predict(prof, Candidate(cp=2), slow, batch_size=4).compute_s - predict(prof, Candidate(cp=2), free,
                                                                                   batch_size=4).compute_s
    q = prof.hidden_bytes * 4 // 2  # 4 samples, half their tokens
    per_call = cp_wire("ring", 2, LINK, q_bytes=q, kv_bytes=2 * q, grad_kv_bytes=2 * q, heads=2, kv_heads=2)
    assert per_call is not None and waited >= CONFIG.n_layer * per_call * 0.99  # every block's attention, both ways
    c = Candidate(dp=2, cp=2, cp_algorithm="ulysses", zero=1)
    assert c.world_size == 4 and str(c) == "dp2 tp1 pp1 cp2 ulysses zero1"
    assert c.flags()[-4:] == ["--cp", "2", "--cp-algorithm", "ulysses"]
    found = layouts(4, CONFIG.n_layer, 8, heads=CONFIG.n_head, tensor_plan=True, per_node=4, cp_sizes=(1, 2))
    assert {(L.cp, L.cp_algorithm) for L in found} == {(1, "ring"), (2, "ring"), (2, "ulysses")}
    assert all(L.world_size == 4 for L in found)


def test_plan_ranks_cp_layouts_when_asked_and_suggests_a_command_that_runs_them(capsys):
    from fourfold.cli.plan import main as plan_main

    assert plan_main(["--nproc", "2", "--cp", "2", "--seq-len", "32", "--n-layer", "2", "--d-model", "16",
                      "--n-head", "2", "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert " cp2 ring " in out and " cp2 ulysses " in out, out
    command = next(line for line in out.splitlines() if "run the first here" in line)
    assert command.count("--cp ") <= 1, command  # the layout's own, never the plan's --cp beside it
