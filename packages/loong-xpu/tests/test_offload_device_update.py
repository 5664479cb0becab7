"""loong_xpu.offload_device_update: the offloaded share of megatron's HybridDeviceOptimizer streamed
through staging buffers and updated by torch's fused AdamW where the gradients are: the same
update as the host's AdamW, chunk by chunk (CPU), and as megatron's host update on a GPU."""

import copy

import pytest
import torch
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

from loong_xpu import get_accelerator, redirect_cuda
from loong_xpu.master_remainder import join_master
from loong_xpu.offload_buckets import buckets
from loong_xpu.offload_device_update import (
    TARGET,
    Piece,
    StagedAdamW,
    adam_state,
    offloaded_pieces,
    update_on_device,
)
from loong_xpu.patches import is_applied
from loong_xpu.testing import train_hybrid_device_optimizer

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _host_masters(hdo) -> list[torch.Tensor]:
    """megatron's host masters of ``hdo`` (a HybridDeviceOptimizer), in its host optimizers' order."""
    return [m for o in hdo.cpu_optimizers for grp in o.param_groups for m in grp["params"]]


def _pieces(masters, states, grads, weights, hyper=HYPER):
    beta1, beta2 = hyper["betas"]
    key = (hyper["lr"], beta1, beta2, hyper["weight_decay"], hyper["eps"])
    pieces = []
    for master, state, grad, weight in zip(masters, states, grads, weights, strict=True):
        state["step"] += 1
        pieces.append(Piece(master, state["exp_avg"], state["exp_avg_sq"], grad, weight, float(state["step"]), key))
    return pieces


def test_staged_chunks_update_exactly_as_torchs_fused_adamw():
    g = torch.Generator().manual_seed(0)
    shapes = [(2500,), (7, 11), (1,), (4096,)]  # one tensor spans three chunks of 1,000, two share one
    reference = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    torch_adamw = torch.optim.AdamW(reference, fused=True, **HYPER)
    masters = [p.detach().clone() for p in reference]
    holder = torch.optim.AdamW(masters, **HYPER)  # keeps the staged update's state, as megatron's host optimizer
    weights = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]
    staged = StagedAdamW(torch.device("cpu"), chunk=1000)
    for _ in range(3):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for p, grad in zip(reference, grads, strict=True):
            p.grad = grad.clone()
        torch_adamw.step()
        states = [adam_state(holder, m) for m in masters]
        staged.update(_pieces(masters, states, grads, weights))
    for p, master, weight in zip(reference, masters, weights, strict=True):
        assert torch.equal(master, p.detach())
        assert torch.equal(holder.state[master]["exp_avg"], torch_adamw.state[p]["exp_avg"])
        assert torch.equal(holder.state[master]["exp_avg_sq"], torch_adamw.state[p]["exp_avg_sq"])
        assert torch.equal(weight, master.bfloat16())  # the weight is the rounded master
    assert all(float(holder.state[m]["step"]) == 3.0 for m in masters)
    # the state is torch AdamW's own layout: a host optimizer could take over from here
    assert set(holder.state[masters[0]]) == set(torch_adamw.state[reference[0]])


def test_bf16_moments_travel_narrow_and_update_in_fp32_rounded_back():
    g = torch.Generator().manual_seed(1)
    shapes = [(2500,), (7, 11), (1,)]
    masters = [torch.randn(s, generator=g) for s in shapes]
    expected = [m.clone() for m in masters]
    holder = torch.optim.AdamW(masters, **HYPER)
    moments = [[torch.zeros(s, dtype=torch.bfloat16) for s in shapes] for _ in range(2)]
    weights = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]
    staged = StagedAdamW(torch.device("cpu"), chunk=1000)
    for step in (1.0, 2.0, 3.0):
        grads = [torch.randn(s, generator=g) for s in shapes]
        # what TE's FusedAdam does with bf16 moments: widened, updated in fp32, rounded to nearest
        wide = [[m.float() for m in ms] for ms in moments]
        torch._fused_adamw_(expected, grads, wide[0], wide[1], [], [torch.tensor(step)] * len(shapes),
                            lr=HYPER["lr"], beta1=0.9, beta2=0.95, weight_decay=HYPER["weight_decay"],
                            eps=HYPER["eps"], amsgrad=False, maximize=False)  # fmt: skip
        moments = [[m.bfloat16() for m in ms] for ms in wide]
        staged.update(_pieces(masters, [adam_state(holder, m, torch.bfloat16) for m in masters], grads, weights))
    for i, master in enumerate(masters):
        state = holder.state[master]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        assert torch.equal(state["exp_avg"], moments[0][i]) and torch.equal(state["exp_avg_sq"], moments[1][i])
        assert torch.equal(master, expected[i]) and torch.equal(weights[i], master.bfloat16())
    # a state written with fp32 moments (the host update, an earlier run) is cast in place as it loads
    exp_avg = holder.state[masters[0]]["exp_avg"]
    exp_avg.data = exp_avg.data.float()
    assert adam_state(holder, masters[0], torch.bfloat16)["exp_avg"] is exp_avg and exp_avg.dtype == torch.bfloat16
    mixed = _pieces(masters[:2], [adam_state(holder, masters[0], torch.bfloat16),
                                  adam_state(holder, masters[1], torch.float16)], grads[:2], weights[:2])  # fmt: skip
    with pytest.raises(ValueError, match=r"moments are in several dtypes \(torch.bfloat16, torch.float16\)"):
        staged.update(mixed)


def test_pieces_pack_into_runs_that_fit_a_chunk():
    def piece(n):
        t = torch.zeros(n)
        return Piece(t, t, t, t, t, 1.0, (0.0, 0.0, 0.0, 0.0, 0.0))

    runs = buckets([piece(n) for n in (600, 300, 200, 1000, 50)], limit=1000)
    assert [[p.master.numel() for p in run] for run in runs] == [[600, 300], [200], [1000], [50]]
    assert buckets([], limit=1000) == []


def test_the_offloaded_share_is_read_as_megatrons_host_optimizers_hold_it():
    # megatron's HybridDeviceOptimizer needs CUDA to be built; its two maps that the device update
    # reads are set up here as it sets them: host masters in host AdamWs, each mapped to its weight
    masters = [torch.zeros(6), torch.zeros(4), torch.zeros(3)]
    weights = [torch.nn.Parameter(torch.zeros(m.shape, dtype=torch.bfloat16)) for m in masters]
    weights[0].decoupled_grad = torch.ones(6)  # megatron's precision-aware gradient
    weights[1].grad = torch.ones(4, dtype=torch.bfloat16)  # or the plain one; the third has none
    optimizers = [torch.optim.AdamW(masters[:2], lr=0.5, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.01),
                  torch.optim.AdamW(masters[2:], lr=0.5)]  # fmt: skip
    hdo = type("HDO", (), {"cpu_optimizers": optimizers, "cpu_copys_map_gpu_param": dict(zip(masters, weights))})()
    for step in (1.0, 2.0):
        pieces = offloaded_pieces(hdo)
        assert [p.master for p in pieces] == masters[:2] and [p.step for p in pieces] == [step, step]
        assert pieces[0].grad is weights[0].decoupled_grad and pieces[1].grad is weights[1].grad
        assert pieces[0].hyper == (0.5, 0.8, 0.9, 0.01, 1e-6)
        assert pieces[0].exp_avg is optimizers[0].state[masters[0]]["exp_avg"]
    assert masters[2] not in optimizers[1].state  # no gradient: left alone, as torch's AdamW leaves it
    optimizers[1].param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad or maximize set, which the device update does not run"):
        offloaded_pieces(hdo)


def test_the_manifest_wraps_megatrons_step_and_marking_needs_it():
    original = HybridDeviceOptimizer.step
    with pytest.raises(RuntimeError, match="needs the manifest's patch of .*HybridDeviceOptimizer.step"):
        update_on_device(object())
    with redirect_cuda(get_accelerator("cpu")):
        assert is_applied(TARGET) and HybridDeviceOptimizer.step.__wrapped__ is original
        assert update_on_device(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)) == 0
        with pytest.raises(ValueError, match="moments=torch.float16; expected torch.float32 or torch.bfloat16"):
            update_on_device(object(), torch.float16)
    assert HybridDeviceOptimizer.step is original


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("offload_fraction", [1.0, 0.5])
def test_the_device_update_gives_the_host_updates_weights_and_state(offload_fraction, monkeypatch):
    from loong_xpu import offload_device_update

    monkeypatch.setattr(offload_device_update, "CHUNK", 1 << 18)  # the 1M-element tensor in four chunks
    with redirect_cuda(get_accelerator("cuda")):
        host, _ = train_hybrid_device_optimizer(offload_fraction, patched=True)
        ours, opt = train_hybrid_device_optimizer(offload_fraction, patched=True, on_device=True)
        # the same fused AdamW, CUDA's build against the CPU's: equal up to the last bits of fp32
        for a, b in zip(host, ours, strict=True):
            assert (a.float() - b.float()).abs().max() <= 2 ** -8 * a.float().abs().max()
            assert (a == b).float().mean() > 0.999
        masters = _host_masters(opt)
        for master in masters:
            state = opt.state[opt.inner_param_to_orig_param[master]]
            assert float(state["step"]) == 3.0 and state["exp_avg"].is_pinned() and state["exp_avg_sq"].is_pinned()
        assert not opt.cpu_copy_map_grad  # no gradient went to the host
        if offload_fraction < 1:
            # megatron moves every sub-optimizer's loaded state to the host when the device share's
            # class is the host's (torch's AdamW on both sides here; TE's FusedAdam in megatron's
            # factory), so a loaded half-offloaded state is checked by the train test instead
            return
        # a state written by the device update loads into the host update and continues there (a
        # copy each: a loaded state shares the tensors it was given, and the first run updates them)
        state_dict = opt.state_dict()
        continued, _ = train_hybrid_device_optimizer(offload_fraction, patched=True, steps=1,
                                                     state_dict=copy.deepcopy(state_dict))
        again, _ = train_hybrid_device_optimizer(offload_fraction, patched=True, on_device=True, steps=1,
                                                 state_dict=copy.deepcopy(state_dict))
        for a, b in zip(continued, again, strict=True):
            assert (a == b).float().mean() > 0.999


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_moments_stream_through_the_gpu_and_stay_bf16_on_the_host(monkeypatch):
    from loong_xpu import offload_device_update

    monkeypatch.setattr(offload_device_update, "CHUNK", 1 << 18)
    with redirect_cuda(get_accelerator("cuda")):
        wide, _ = train_hybrid_device_optimizer(1.0, patched=True, on_device=True)
        narrow, opt = train_hybrid_device_optimizer(1.0, patched=True, on_device=True, moments=torch.bfloat16)
    # moments rounded to bf16 move each update by ~2^-9 of itself (lr 1e-2 a step here): the masters
    # drift apart by far less than an update, so weights land one bf16 step apart, or a few where the
    # weight is small enough for its step to be finer than that drift; moments left unwidened or
    # unrounded would move them by whole updates
    for a, b in zip(wide, narrow, strict=True):
        step = 2.0 ** (torch.floor(torch.log2(a.float().abs().clamp_min(1e-30))) - 7)  # one bf16 step at a
        far = int(((a.float() - b.float()).abs() > step + 3 * 1e-2 * 2**-6).sum())
        equal = float((a == b).float().mean())
        assert far == 0 and equal > 0.95, (far, equal)
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].dtype == torch.bfloat16 and state[key].is_pinned() and state[key].abs().sum() > 0


class _HostShare:
    """The parts of megatron's HybridDeviceOptimizer that :func:`device_step` reads, set up as megatron
    sets them (host fp32 masters in host AdamWs, each mapped to its bf16 weight; no device share):
    megatron's class needs CUDA to be built."""

    def __init__(self, weights: list[torch.nn.Parameter], **hyper):
        self.masters = [w.detach().float() for w in weights]
        self.cpu_optimizers = [torch.optim.AdamW(self.masters, **hyper)]
        self.cpu_copys_map_gpu_param = dict(zip(self.masters, weights, strict=True))
        self.gpu_optimizer = None
        self._d2h_stream, self._h2d_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def _nothing_to_sync(self):
        """megatron's syncs between its own state and its sub-optimizers': with one host optimizer
        and no device share, that state is the host optimizer's own, so there is nothing to copy."""

    _sync_hdo_param_groups_to_sub_optimizers = _set_sub_optimizer_grads = _nothing_to_sync
    _sync_sub_optimizers_state_to_hdo = _nothing_to_sync


def test_masters_kept_as_low_halves_update_exactly_as_torchs_fused_adamw(monkeypatch):
    from loong_xpu import offload_device_update as odu

    monkeypatch.setattr(odu, "CHUNK", 1000)  # the 2,500-element tensor in three chunks
    g = torch.Generator().manual_seed(2)
    shapes = [(2500,), (7, 11), (1,)]
    with redirect_cuda(get_accelerator("cpu")):
        weights = [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in shapes]
        reference = [torch.nn.Parameter(w.detach().float()) for w in weights]
        torch_adamw = torch.optim.AdamW(reference, fused=True, **HYPER)
        hdo = _HostShare(weights, **HYPER)
        setattr(hdo, odu.REMAINDERS, odu.Remainders())
        remainders = getattr(hdo, odu.REMAINDERS)
        initial = [m.clone() for m in hdo.masters]

        def step():
            for w, r in zip(weights, reference, strict=True):
                w.decoupled_grad = torch.randn(w.shape, generator=g)
                r.grad = w.decoupled_grad.clone()
            torch_adamw.step()
            odu.device_step(hdo)

        for _ in range(3):
            step()
        # the first step read the masters from the host; after it only the low halves travel, and
        # megatron's host masters are left behind until something reads them
        assert all(torch.equal(m, i) for m, i in zip(hdo.masters, initial, strict=True))
        assert remainders.ahead == remainders.current == set(hdo.masters)
        for w, r, master in zip(weights, reference, hdo.masters, strict=True):
            joined = torch.empty(master.shape)
            join_master(w.detach(), remainders.tensors[master], joined)
            assert torch.equal(joined, r.detach())  # the master bit for bit
            _, tes_rounding = _split_like_te(r.detach())
            assert torch.equal(w.detach(), tes_rounding)
            state = hdo.cpu_optimizers[0].state[master]
            assert torch.equal(state["exp_avg"], torch_adamw.state[r]["exp_avg"])
        assert odu.write_back_masters(hdo, chunk=1000) == len(shapes)
        assert all(torch.equal(m, r.detach()) for m, r in zip(hdo.masters, reference, strict=True))
        assert not remainders.ahead and odu.write_back_masters(hdo) == 0
        step()  # both current: the low halves travel
        assert all(torch.equal(w.detach(), _split_like_te(r.detach())[1]) for w, r in zip(weights, reference))

        # megatron writes its host masters (a loaded checkpoint): the next step reads them from there
        for master, r in zip(hdo.masters, reference, strict=True):
            master.mul_(0.5)
            r.data.copy_(master)
        odu._host_masters_rewritten(hdo)
        assert not remainders.current
        step()
        for w, r, master in zip(weights, reference, hdo.masters, strict=True):
            joined = torch.empty(master.shape)
            join_master(w.detach(), remainders.tensors[master], joined)
            assert torch.equal(joined, r.detach())


def _split_like_te(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's rounding, computed apart from loong_xpu.master_remainder: the high half, one more where
    the low half is >= 0x8000."""
    unsigned = master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    high = ((unsigned >> 16) + ((unsigned & 0xFFFF) >= 0x8000).to(torch.int64)) & 0xFFFF
    high = torch.where(high >= 1 << 15, high - (1 << 16), high).to(torch.int16)
    return (unsigned & 0xFFFF), high.view(torch.bfloat16)


def test_keeping_masters_as_low_halves_needs_bf16_weights_and_the_manifests_wraps():
    from loong_xpu import offload_device_update as odu

    with redirect_cuda(get_accelerator("cpu")):
        weights = [torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))]
        hdo = _HostShare(weights, **HYPER)
        weights[0].decoupled_grad = torch.ones(4)
        with pytest.raises(ValueError, match="an offloaded weight is torch.float16; .* needs bf16 weights"):
            odu.offloaded_pieces(hdo, remainders=odu.Remainders())
        for target in odu.REMAINDER_TARGETS:
            assert is_applied(target)
    with pytest.raises(RuntimeError, match="needs the manifest's patch"):
        update_on_device(object(), remainders=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_masters_kept_as_low_halves_on_the_gpu_give_the_fp32_masters_and_resume(monkeypatch):
    from loong_xpu import offload_device_update as odu

    monkeypatch.setattr(odu, "CHUNK", 1 << 18)
    with redirect_cuda(get_accelerator("cuda")):
        whole, fp32_opt = train_hybrid_device_optimizer(1.0, patched=True, on_device=True)
        halves, opt = train_hybrid_device_optimizer(1.0, patched=True, on_device=True, remainders=True)
        # the same CUDA kernel on the same masters: only the weights' rounding at exact ties differs
        for a, b in zip(whole, halves, strict=True):
            differs = a != b
            assert differs.float().mean() < 1e-3
            assert ((a.float() - b.float()).abs()[differs] <= a.float().abs()[differs] * 2**-7).all()
        # state_dict writes megatron's host masters back first: they are the fp32 path's bit for bit
        state_dict = opt.state_dict()
        assert all(torch.equal(a, b) for a, b in zip(_host_masters(opt), _host_masters(fp32_opt), strict=True))
        # a state saved this way loads into either layout and continues alike
        continued, _ = train_hybrid_device_optimizer(1.0, patched=True, on_device=True, steps=1,
                                                     state_dict=copy.deepcopy(fp32_opt.state_dict()))
        again, loaded = train_hybrid_device_optimizer(1.0, patched=True, on_device=True, steps=1, remainders=True,
                                                      state_dict=copy.deepcopy(state_dict))
        for a, b in zip(continued, again, strict=True):
            assert (a != b).float().mean() < 1e-3
        assert getattr(loaded, odu.REMAINDERS).current  # it stepped on from the loaded host masters
