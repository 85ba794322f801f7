"""The expert cache budget: the pure arithmetic, cgroup v1/v2 probing on fake /sys trees, the real machine,
and (when permitted) a real cgroup v1 child with a limit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from moe_pipe.shared.config import load_config
from moe_pipe.shared.errors import ConfigError
from moe_pipe.shared.experts.budget import (
    SMALL_PASS_ROWS,
    UNLIMITED,
    CacheFloor,
    CgroupLimit,
    KVLoan,
    MemoryProbe,
    MiB,
    PromptLoan,
    check_floor,
    compute_budget,
    kv_lendable_bytes,
    probe_memory,
    prompt_lendable_bytes,
    resolve_budget,
    role_bytes,
    service_kv_bytes,
)
from moe_pipe.shared.gguf.spec import kv_cache_bytes, kv_pool_bytes, prefill_activation_bytes

GiB = 1 << 30


def probe(host: int, *cgroups: tuple[int, int, int]) -> MemoryProbe:
    return MemoryProbe(host, tuple(CgroupLimit(f"cg{i}", *c) for i, c in enumerate(cgroups)))


# ---------------------------------------------------------------- the pure function


def test_auto_subtracts_dense_kv_reserve_and_clamps():
    mem = probe(8 * GiB)
    b = compute_budget("auto", 100000, mem, dense_bytes=1 * GiB, kv_bytes=256 * MiB, dense_policy="anon", reserve_mb=512)
    assert b.bytes == 8 * GiB - 1 * GiB - 256 * MiB - 512 * MiB and b.mode == "auto" and not b.clamped
    assert (b.available_bytes, b.dense_bytes, b.kv_bytes, b.reserve_bytes) == (8 * GiB, GiB, 256 * MiB, 512 * MiB)
    for word in ("auto", "host available 8192 MiB", "dense 1024 MiB (anon)", "KV 256 MiB", "reserve 512 MiB", "6400 MiB"):
        assert word in b.description, b.description
    clamped = compute_budget("auto", 4000, mem, dense_bytes=GiB, kv_bytes=0, dense_policy="anon")
    assert clamped.bytes == 4000 * MiB and clamped.clamped and "clamped to cache_ceil_mb 4000" in clamped.description
    assert "\n" not in clamped.description


def test_the_kv_cache_lends_an_auto_budget_its_unused_rows():
    """The KV cache's loan: an auto budget borrows the lendable part of the KV reservation,
    a clamped one too (the memory is counted in the KV reservation already); a fixed
    budget borrows nothing."""
    mem = probe(8 * GiB)
    kw = dict(dense_bytes=GiB, kv_bytes=512 * MiB, dense_policy="anon", reserve_mb=512)
    b = compute_budget("auto", 100000, mem, lendable_bytes=384 * MiB, **kw)
    assert b.bytes == 8 * GiB - GiB - 512 * MiB - 512 * MiB and b.lent_bytes == 384 * MiB
    assert "up to 384 MiB of the KV cache's while the context is short" in b.description
    clamped = compute_budget("auto", 4000, mem, lendable_bytes=384 * MiB, **kw)
    assert clamped.clamped and clamped.bytes == 4000 * MiB and clamped.lent_bytes == 384 * MiB
    assert compute_budget(2000, 100000, mem, lendable_bytes=384 * MiB, **kw).lent_bytes == 0  # fixed
    assert compute_budget("auto", 100000, mem, **kw).lent_bytes == 0  # nothing lendable


def test_a_long_prompts_allowance_is_lent_as_far_as_it_raises_the_reserve():
    """The prompt's loan: of the activations' allowance in the engine's estimate, an auto budget
    lends what the reserve holds beyond reserve_mb and the processes' own part (the memory only
    a long pass uses), a clamped one too; a fixed one and a reserve_mb above it all lend nothing."""
    mem = probe(8 * GiB)
    kw = dict(dense_bytes=GiB, kv_bytes=512 * MiB, dense_policy="anon", reserve_mb=512)
    b = compute_budget("auto", 100000, mem, engine_bytes=900 * MiB, prompt_bytes=420 * MiB, **kw)
    assert b.bytes == 8 * GiB - GiB - 512 * MiB - 900 * MiB and b.prompt_lent_bytes == 900 * MiB - 512 * MiB
    assert "and 388 MiB of a long prompt's while none runs" in b.description
    whole = compute_budget("auto", 100000, mem, engine_bytes=1000 * MiB, prompt_bytes=420 * MiB, **kw)
    assert whole.prompt_lent_bytes == 420 * MiB  # the processes alone are above reserve_mb: all of it
    assert compute_budget("auto", 4000, mem, engine_bytes=1000 * MiB, prompt_bytes=420 * MiB, **kw).prompt_lent_bytes == 420 * MiB
    assert compute_budget("auto", 100000, mem, engine_bytes=500 * MiB, prompt_bytes=420 * MiB, **kw).prompt_lent_bytes == 0
    assert compute_budget(2000, 100000, mem, engine_bytes=1000 * MiB, prompt_bytes=420 * MiB, **kw).prompt_lent_bytes == 0
    # in slabs: the budget's own first, then the KV cache's loan, then the prompt's, never more than the model's experts
    both = compute_budget("auto", 100000, mem, engine_bytes=1000 * MiB, prompt_bytes=420 * MiB, lendable_bytes=100 * MiB, **kw)
    own = both.bytes // MiB
    assert both.slabs(MiB, 10**6) == (own, 100, 420)
    assert both.slabs(MiB, own + 150) == (own, 100, 50) and both.slabs(MiB, own) == (own, 0, 0)


def test_what_a_pass_takes_of_the_prompts_loan(tiny_model):
    """A pass of a few rows takes nothing back; a longer one what its activations need, in whole
    slabs, never more than was lent; off (--no-lend-prompt) or with several slots nothing is lent."""
    from moe_pipe.shared.gguf.model_file import open_model

    with open_model(tiny_model) as mf:
        spec = mf.spec
    cfg = load_config(None, {"compute.ctx_size": 512})
    lendable = prompt_lendable_bytes(cfg, spec, spec.n_expert_used)
    assert lendable == prefill_activation_bytes(spec, 512, spec.n_expert_used)
    assert prompt_lendable_bytes(load_config(None, {"compute.ctx_size": 512, "cache.lend_prompt": False}), spec, 2) == 0
    assert prompt_lendable_bytes(load_config(None, {"compute.ctx_size": 512, "gateway.parallel": 2}), spec, 2) == 0
    slab = 4096
    loan = PromptLoan(lendable // slab, slab, spec, spec.n_expert_used)
    assert loan.slabs_for(1) == loan.slabs_for(SMALL_PASS_ROWS) == 0
    taken = [loan.slabs_for(n) for n in (SMALL_PASS_ROWS + 1, 64, 256, 512, 4096)]
    assert 0 < taken[0] and taken == sorted(taken) and taken[-1] == loan.lent_slabs
    need = prefill_activation_bytes(spec, 64, spec.n_expert_used)
    assert loan.slabs_for(64) == -(-need // slab)
    assert PromptLoan(0, slab, spec, 2).slabs_for(4096) == 0
    # compute's own pages above their estimate (kernels compiled, not loaded) are never lent
    estimate = role_bytes("compute", spec.n_vocab)
    assert loan.withheld_for(estimate) == loan.withheld_for(estimate // 2) == 0
    assert loan.withheld_for(estimate + 1) == 1 and loan.withheld_for(estimate + 3 * slab) == 3
    assert loan.withheld_for(estimate + 10**12) == loan.lent_slabs
    assert loan.slabs_for(1, withheld=3) == 3 and loan.slabs_for(64, withheld=3) == 3 + loan.slabs_for(64)
    assert loan.slabs_for(4096, withheld=3) == loan.lent_slabs


def test_what_the_kv_cache_lends_and_how_it_is_taken_back(tiny_model):
    """One slot lends its whole-context rows (not a ring, not a pool); compute takes the
    slabs back as positions grow, and at a full context holds none of the loan."""
    from moe_pipe.shared.gguf.model_file import open_model

    cfg = load_config(None, {"compute.ctx_size": 512})
    with open_model(tiny_model) as mf:
        spec = mf.spec
    lendable = kv_lendable_bytes(cfg, spec)
    assert 0 < lendable <= kv_cache_bytes(spec, 512, "f16")
    assert kv_lendable_bytes(load_config(None, {"compute.ctx_size": 512, "cache.lend_kv": False}), spec) == 0
    assert kv_lendable_bytes(load_config(None, {"compute.ctx_size": 512, "gateway.parallel": 2}), spec) == 0
    slab = 4096
    loan = KVLoan.of(100, lendable // slab, slab, spec, "f16")
    at = [loan.slabs_at(n) for n in (0, 1, 64, 256, 512)]
    assert at[0] == 100 and at == sorted(at, reverse=True) and at[1] < 100
    assert at[-1] == 100 - loan.lent_slabs  # the whole context: every lent slab is back
    held = 200 * loan.position_bytes + loan.page_slack  # what 200 positions' rows can take
    assert (100 - loan.slabs_at(200)) * slab >= held > (100 - loan.slabs_at(200) - 1) * slab
    assert loan.ahead > 0
    assert KVLoan(100, 0, slab, 10, 0).slabs_at(10**6) == 100  # nothing lent: nothing to take back


@pytest.mark.parametrize("policy", ["anon", "warm", "mmap"])
def test_dense_counted_when_it_fits(policy):
    b = compute_budget("auto", 1e6, probe(4 * GiB), dense_bytes=GiB, kv_bytes=0, dense_policy=policy, reserve_mb=0, floor_bytes=GiB)
    assert b.bytes == 3 * GiB and b.dense_bytes == GiB and f"dense 1024 MiB ({policy})" in b.description


def test_a_mapped_dense_set_keeps_what_one_tokens_experts_leave():
    """Every token reads the whole dense set, so a mapped one (file pages) is left the memory the
    smallest cache does not need (a cache that took it would have the dense pages read again each
    token); only what does not fit beside that floor is paged. Resident, it is counted whole."""
    mem = probe(10 * GiB)
    part = compute_budget("auto", 1e6, mem, dense_bytes=9 * GiB, kv_bytes=GiB, dense_policy="mmap", reserve_mb=1024, floor_bytes=2 * GiB)
    assert part.dense_bytes == 6 * GiB and part.bytes == 2 * GiB  # the cache at its floor, the dense set all the rest
    assert "dense 6144 MiB of 9216 MiB (mmap: what one token's experts leave; the rest is paged)" in part.description
    none = compute_budget("auto", 1e6, mem, dense_bytes=9 * GiB, kv_bytes=GiB, dense_policy="mmap", reserve_mb=1024, floor_bytes=9 * GiB)
    assert none.dense_bytes == 0 and none.bytes == 8 * GiB and "no room beside one token's experts" in none.description
    anon = compute_budget("auto", 1e6, mem, dense_bytes=9 * GiB, kv_bytes=GiB, dense_policy="anon", reserve_mb=1024, floor_bytes=2 * GiB)
    assert anon.dense_bytes == 9 * GiB and anon.bytes == 0  # below the floor: resolve_budget refuses it


def test_auto_never_negative():
    b = compute_budget("auto", 4000, probe(100 * MiB), dense_bytes=GiB, kv_bytes=GiB, dense_policy="anon")
    assert b.bytes == 0


def test_tightest_cgroup_wins_and_inactive_file_is_not_used():
    # host has 16 GiB; outer cgroup 12 GiB with 2 GiB used; inner 3 GiB with 1 GiB used of which 0.5 is inactive file
    mem = probe(16 * GiB, (12 * GiB, 2 * GiB, 0), (3 * GiB, GiB, GiB // 2))
    assert mem.available_bytes == 3 * GiB - GiB // 2
    assert "free in cg1" in mem.describe() and "limit 3072 MiB" in mem.describe()
    # a cgroup looser than the host does not decide
    loose = probe(2 * GiB, (64 * GiB, GiB, 0))
    assert loose.available_bytes == 2 * GiB and "not tighter" in loose.describe()
    over = probe(2 * GiB, (GiB, 2 * GiB, 0))  # usage above the limit: no headroom, not negative
    assert over.available_bytes == 0


def test_fixed_budget_fractional_and_clamped():
    b = compute_budget(0.5, 4000, None, dense_bytes=GiB, kv_bytes=GiB, dense_policy="anon")
    assert b.bytes == 512 * 1024 and b.mode == "fixed" and not b.clamped and "fixed cache_mb 0.5" in b.description
    c = compute_budget(5000, 4000, None, dense_bytes=0, kv_bytes=0, dense_policy="anon")
    assert c.bytes == 4000 * MiB and c.clamped and c.to_dict()["mb"] == 4000
    with pytest.raises(ValueError):
        compute_budget("auto", 4000, None, dense_bytes=0, kv_bytes=0, dense_policy="anon")


def test_floor_refusal_says_what_would_work():
    small = compute_budget(0.25, 4000, None, dense_bytes=0, kv_bytes=0, dense_policy="anon")
    two_layers = CacheFloor(n_layer=2, top_k=2, slab_bytes=MiB // 4)  # 1 MiB
    with pytest.raises(ConfigError) as exc:
        check_floor(small, two_layers, "t.toml")
    assert str(exc.value) == (
        "t.toml: expert cache of 0.25 MiB is below one token's working set of "
        "1.00 MiB = 2 layers x top-2 experts x 0.25 MiB slabs; set cache_mb to at least 1"
    )
    assert check_floor(small, CacheFloor(1, 1, 256 * 1024)) == 1
    ceil = compute_budget("auto", 0.5, probe(GiB), dense_bytes=0, kv_bytes=0, dense_policy="anon", reserve_mb=0)
    with pytest.raises(ConfigError, match=r"cache_ceil_mb 0.5 is below .* 2 layers x top-2 .*; raise it to at least 1$"):
        check_floor(ceil, two_layers)
    tight = compute_budget("auto", 4000, probe(600 * MiB), dense_bytes=50 * MiB, kv_bytes=0, dense_policy="anon")
    with pytest.raises(ConfigError) as exc:
        check_floor(tight, CacheFloor(n_layer=4, top_k=5, slab_bytes=5 * MiB), "tiny.toml")
    msg = str(exc.value)
    assert "not enough memory" in msg and "budget 38 MiB" in msg and "100.00 MiB = 4 layers x top-5 experts" in msg, msg
    assert "62 MiB short" in msg, msg


def test_resolve_budget_from_config(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[cache]\ncache_mb = "auto"\ncache_ceil_mb = 100\nreserve_mb = 64\n[io]\ndense_weights = "warm"\n')
    cfg = load_config(p)
    b = resolve_budget(cfg, dense_bytes=10 * MiB, kv_bytes=6 * MiB, memory=probe(120 * MiB))
    assert b.bytes == 40 * MiB and b.dense_bytes == 10 * MiB
    with pytest.raises(ConfigError, match=str(p)):
        resolve_budget(cfg, dense_bytes=10 * MiB, kv_bytes=6 * MiB, memory=probe(120 * MiB), floor=CacheFloor(41, 1, MiB))
    real = resolve_budget(load_config(None, {"cache.cache_mb": "auto"}), dense_bytes=0, kv_bytes=0)
    assert real.mode == "auto" and real.bytes > 0


@pytest.mark.parametrize("arch", ["gemma4", "gpt-oss"])
def test_the_budget_counts_a_sliding_layers_ring_and_the_expert_cache_gets_the_rest(arch, tmp_path):
    """At 4,096 positions the tiny model's sliding layers (window 128) keep rings of 128 - 1 + 512
    rows: the footprint and the auto budget count what the model's cache allocates, and the
    expert cache gets what the rings save against every layer keeping the whole context."""
    from dataclasses import replace

    from moe_pipe.shared.analysis.fit import memory_fit, model_footprint
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.gguf.spec import SWA_PROMPT_BLOCK, kv_cache_bytes
    from moe_pipe.shared.makemodel.maker import make_model
    from moe_pipe.shared.model.load import ModelOptions, load_model

    path = make_model(arch, "tiny", tmp_path / "m.gguf")
    cfg = load_config(None, {"compute.ctx_size": 4096, "cache.cache_ceil_mb": 1e6, "cache.reserve_mb": 0})
    with open_model(path) as mf:
        spec, dense = mf.spec, mf.layout.dense_bytes
        footprint = model_footprint(mf, cfg)
        allocated = sum(a.nbytes for a in load_model(mf, options=ModelOptions(kv_type="f16")).new_cache(4096).parts())
    ring = 128 - 1 + SWA_PROMPT_BLOCK
    by_hand = 2 * sum(
        (ring if swa else 4096) * hk * (dk + dv)
        for swa, hk, dk, dv in zip(spec.swa_layers, spec.n_head_kv, spec.head_dim_k, spec.head_dim_v)
    )
    whole = kv_cache_bytes(replace(spec, sliding_window=0), 4096, "f16")
    assert footprint.kv_bytes == allocated == by_hand < whole
    assert (footprint.kv_ring_layers, footprint.kv_ring_rows) == (sum(spec.swa_layers), ring)
    fitted = memory_fit(footprint, cfg, probe(4 * GiB))
    assert fitted.budget.kv_bytes == by_hand and f"KV {by_hand / MiB:.3g} MiB" in fitted.budget.description
    assert fitted.budget.bytes == 4 * GiB - dense - by_hand - footprint.engine_bytes
    # the same budget with every layer keeping 4,096 positions: the difference is the rings' saving
    assert fitted.budget.bytes - (4 * GiB - dense - whole - footprint.engine_bytes) == whole - by_hand


# ---------------------------------------------------------------- probing fake trees


def _files(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)


def test_probe_cgroup_v1_fake_tree(tmp_path):
    sysfs, proc = tmp_path / "sys", tmp_path / "cgroup"
    proc.write_text("12:cpu,cpuacct:/x\n4:memory:/outer/inner\n0::/\n")
    _files(
        sysfs,
        {
            "memory/memory.limit_in_bytes": str(9223372036854771712),  # root: unlimited
            "memory/outer/memory.limit_in_bytes": str(2 * GiB),
            "memory/outer/memory.usage_in_bytes": str(GiB),
            "memory/outer/memory.stat": f"cache 0\ntotal_inactive_file {256 * MiB}\n",
            "memory/outer/inner/memory.limit_in_bytes": str(UNLIMITED + 4096),  # unlimited at the leaf
            "memory/outer/inner/memory.usage_in_bytes": str(GiB),
        },
    )
    mem = probe_memory(sysfs, proc, host_available_bytes=8 * GiB)
    assert len(mem.cgroups) == 1 and mem.cgroups[0].where.endswith("memory/outer")
    assert mem.available_bytes == 2 * GiB - (GiB - 256 * MiB)
    assert mem.describe().startswith("1280 MiB free in cgroup v1")


def test_probe_cgroup_v1_leaf_limit_and_namespaced_mount(tmp_path):
    sysfs, proc = tmp_path / "sys", tmp_path / "cgroup"
    # inside a container the mount root is already our cgroup: /proc says /docker/abc, the files sit at the root
    proc.write_text("4:memory:/docker/abc\n")
    _files(sysfs, {"memory/memory.limit_in_bytes": str(512 * MiB), "memory/memory.usage_in_bytes": str(12 * MiB)})
    mem = probe_memory(sysfs, proc, host_available_bytes=8 * GiB)
    assert mem.available_bytes == 500 * MiB


def test_probe_cgroup_v2_fake_tree(tmp_path):
    sysfs, proc = tmp_path / "sys", tmp_path / "cgroup"
    proc.write_text("0::/user.slice/app\n")
    _files(
        sysfs,
        {
            "cgroup.controllers": "cpu memory\n",
            "user.slice/memory.max": str(3 * GiB),
            "user.slice/memory.current": str(GiB),
            "user.slice/app/memory.max": "max\n",
            "user.slice/app/memory.high": str(1536 * MiB),
            "user.slice/app/memory.current": str(600 * MiB),
            "user.slice/app/memory.stat": f"anon 1\ninactive_file {100 * MiB}\n",
        },
    )
    mem = probe_memory(sysfs, proc, host_available_bytes=8 * GiB)
    assert {c.limit_bytes for c in mem.cgroups} == {3 * GiB, 1536 * MiB}
    assert mem.available_bytes == 1536 * MiB - 500 * MiB


def test_probe_cgroup_v2_hybrid_mount(tmp_path):
    sysfs, proc = tmp_path / "sys", tmp_path / "cgroup"
    proc.write_text("4:memory:/\n0::/svc\n")
    _files(
        sysfs,
        {
            "memory/memory.limit_in_bytes": str(9223372036854771712),
            "unified/cgroup.controllers": "",
            "unified/svc/memory.max": str(GiB),
            "unified/svc/memory.current": str(GiB // 4),
        },
    )
    mem = probe_memory(sysfs, proc, host_available_bytes=8 * GiB)
    assert mem.available_bytes == 3 * GiB // 4 and "cgroup v2" in mem.describe()


def test_probe_without_cgroups_is_the_host(tmp_path):
    mem = probe_memory(tmp_path / "nothing", tmp_path / "no-proc-file", host_available_bytes=5 * GiB)
    assert mem.cgroups == () and mem.available_bytes == 5 * GiB and mem.describe() == "host available 5120 MiB"


# ---------------------------------------------------------------- the real machine


def test_probe_real_machine_smoke():
    mem = probe_memory()
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < mem.available_bytes <= total
    assert mem.describe()


_CHILD = (
    "import json; from moe_pipe.shared.experts.budget import probe_memory; m = probe_memory(); "
    "print(json.dumps({'available': m.available_bytes, 'describe': m.describe()}))"
)


def _own_v1_memory_cgroup() -> Path | None:
    root = Path("/sys/fs/cgroup/memory")
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                d = root / path.lstrip("/")
                return d if d.is_dir() else root
    except OSError:
        pass
    return root if root.is_dir() else None


@pytest.mark.integration
def test_real_cgroup_v1_child_sees_its_limit():
    parent = _own_v1_memory_cgroup()
    if parent is None or not (parent / "memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory hierarchy")
    cg = parent / f"moe-pipe-test-{uuid.uuid4().hex[:8]}"
    try:
        cg.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup here: {exc}")
    child = None
    try:
        limit = 300 * MiB
        (cg / "memory.limit_in_bytes").write_text(str(limit))
        # the shell waits for a line, so it joins the cgroup before Python starts (exec keeps the pid)
        child = subprocess.Popen(
            ["sh", "-c", f'read go; exec {sys.executable} -c "{_CHILD}"'], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        (cg / "cgroup.procs").write_text(str(child.pid))
        out, _ = child.communicate("go\n", timeout=60)
        seen = json.loads(out)
        assert seen["available"] <= limit and seen["available"] > limit - 200 * MiB, seen
        assert str(cg) in seen["describe"] and "limit 300 MiB" in seen["describe"], seen
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        for _ in range(50):  # the kernel lets go of an emptied cgroup a moment after its last task exits
            try:
                cg.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
        assert not cg.exists(), f"left {cg} behind"


# ---------------------------------------------------------------- the engine's own processes


def test_engine_estimate_counts_each_child_and_the_shared_code_once():
    from moe_pipe.shared.experts.budget import ROLE_PRIVATE_MIB, RUN_ROLES, SERVICE_ROLES, SHARED_CODE_MIB, engine_bytes

    run, up = engine_bytes(RUN_ROLES, 2048), engine_bytes(SERVICE_ROLES, 2048)
    assert run == sum(ROLE_PRIVATE_MIB[r] for r in RUN_ROLES) * MiB + 600 * 2048 + SHARED_CODE_MIB * MiB
    assert up - run == ROLE_PRIVATE_MIB["gateway"] * MiB + 300 * 2048  # the gateway: its own pages and tokenizer
    assert engine_bytes(RUN_ROLES, 151936) - run == 600 * (151936 - 2048)  # a bigger vocab costs compute
    assert engine_bytes((), 2048) == 0
    with pytest.raises(ValueError, match="no memory estimate"):
        engine_bytes(("reader", "llama"), 2048)


def test_auto_leaves_the_larger_of_reserve_and_the_processes():
    mem = probe(2 * GiB)
    low = compute_budget(
        "auto", 1e6, mem, dense_bytes=100 * MiB, kv_bytes=50 * MiB, dense_policy="anon", reserve_mb=64, engine_bytes=400 * MiB
    )
    assert low.bytes == 2 * GiB - 100 * MiB - 50 * MiB - 400 * MiB
    assert low.reserve_bytes == low.engine_bytes == 400 * MiB
    assert "processes 400 MiB (estimated; more than reserve_mb 64)" in low.description, low.description
    high = compute_budget(
        "auto", 1e6, mem, dense_bytes=100 * MiB, kv_bytes=50 * MiB, dense_policy="anon", reserve_mb=1024, engine_bytes=400 * MiB
    )
    assert high.bytes == 2 * GiB - 100 * MiB - 50 * MiB - 1024 * MiB and "reserve 1024 MiB" in high.description


def test_floor_refusal_counts_what_the_processes_take():
    tight = compute_budget(
        "auto", 4000, probe(300 * MiB), dense_bytes=10 * MiB, kv_bytes=8 * MiB, dense_policy="anon", reserve_mb=0, engine_bytes=350 * MiB
    )
    with pytest.raises(ConfigError) as exc:
        check_floor(tight, CacheFloor(2, 1, MiB), "tiny.toml")
    msg = str(exc.value)
    # 300 - 10 - 8 - 350 = -68 MiB left: 70 MiB short of a 2 MiB floor, not 2
    assert "processes 350 MiB (estimated" in msg and "70 MiB short" in msg, msg
    assert "reserve_mb" not in msg.split("short")[1]  # lowering it cannot help: it is already below the processes
    assert "\n" not in msg


def test_a_fixed_cache_that_cannot_fit_is_refused_with_the_numbers(tmp_path):
    from moe_pipe.shared.experts.budget import check_fit

    mem = probe(1 * GiB)
    fits = compute_budget(400, 4000, mem, dense_bytes=100 * MiB, kv_bytes=50 * MiB, dense_policy="anon", engine_bytes=400 * MiB)
    check_fit(fits, mem, "c.toml")
    over = compute_budget(600, 4000, mem, dense_bytes=100 * MiB, kv_bytes=50 * MiB, dense_policy="anon", engine_bytes=400 * MiB)
    with pytest.raises(ConfigError) as exc:
        check_fit(over, mem, "c.toml")
    msg = str(exc.value)
    assert "cache_mb 600 does not fit" in msg and "1150 MiB" in msg and "lower cache_mb to 474" in msg, msg
    # 550: refused with the dense set resident; fits when the dense set is left to the page cache
    with pytest.raises(ConfigError):
        check_fit(
            compute_budget(550, 4000, mem, dense_bytes=100 * MiB, kv_bytes=50 * MiB, dense_policy="anon", engine_bytes=400 * MiB), mem
        )
    check_fit(compute_budget(550, 4000, mem, dense_bytes=100 * MiB, kv_bytes=50 * MiB, dense_policy="mmap", engine_bytes=400 * MiB), mem)


# ---------------------------------------------------------------- in a real memory cgroup

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "moe_pipe.cli.main"]
TINY = str(ROOT / "configs" / "tiny.toml")
PARENT_ALLOWANCE = 96 * MiB  # the CLI process itself, already in the cgroup when it probes (measured ~50 MiB)


def _tiny_need(roles) -> int:
    """What auto needs for the tiny model under `roles`, besides the parent."""
    from moe_pipe.shared.experts.budget import engine_bytes
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.gguf.spec import kv_cache_bytes
    from moe_pipe.shared.makemodel.default_model import default_model_path

    with open_model(default_model_path()) as mf:
        c = load_config(TINY).compute
        kv = kv_cache_bytes(mf.spec, c.ctx_size, c.kv_type)
        return engine_bytes(roles, mf.spec.n_vocab) + mf.layout.dense_bytes + kv + mf.layout.min_cache_bytes()


@pytest.fixture
def cgroup():
    from moe_pipe.shared.analysis.cgroup import MemoryCgroup, MemoryLimitError

    made = []

    def make(limit_bytes: int):
        try:
            made.append(MemoryCgroup.create(limit_bytes / MiB))
        except MemoryLimitError as exc:
            pytest.skip(str(exc))
        return made[-1]

    yield make
    for cg in made:
        cg.remove()


def _segments_of(pid: int) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"moe-pipe-{pid}-*")]


@pytest.mark.integration
def test_run_near_its_limit_fits_and_a_smaller_limit_is_refused_with_the_numbers(cgroup):
    from moe_pipe.shared.experts.budget import RUN_ROLES

    need = _tiny_need(RUN_ROLES)
    run = [*CLI, "run", TINY, "-p", "Once upon a time", "-n", "16", "--reserve-mb", "0", "--output-format", "json"]
    near = cgroup(need + PARENT_ALLOWANCE + 8 * MiB)
    r = subprocess.run(near.wrap(run), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "auto" in r.stderr and "processes" in r.stderr
    assert near.oom_kills() == 0 and near.peak_bytes() < near.limit_bytes
    assert (near.path / "memory.failcnt").read_text().strip() == "0"  # it never even touched the limit
    small = cgroup((need - 64 * MiB) // MiB * MiB)  # whole MiB, as the message prints it
    p = subprocess.Popen(small.wrap(run), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "not enough memory" in lines[0] and "MiB short" in lines[0], err
    assert f"limit {small.limit_bytes // MiB} MiB" in lines[0] and "processes" in lines[0], lines[0]
    assert small.oom_kills() == 0 and not _segments_of(p.pid)


def _private_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no Anonymous line for pid {pid}")


@pytest.mark.integration
def test_service_in_a_tight_cgroup_answers_and_each_child_is_within_its_estimate(cgroup, tmp_path):
    """`up` in a cgroup its estimate barely fits: it answers, never reaches the
    limit, and no child holds more private memory than ROLE_PRIVATE_MIB allows
    (the table in shared/experts/budget.py goes stale when a process grows)."""
    import urllib.request

    from moe_pipe.shared.experts.budget import ROLE_PRIVATE_MIB, SERVICE_ROLES, VOCAB_BYTES_PER_TOKEN

    cg = cgroup(_tiny_need(SERVICE_ROLES) + PARENT_ALLOWANCE + 8 * MiB)
    base = Path(tempfile.mkdtemp(prefix="mpb", dir="/tmp"))
    env = {**os.environ, "XDG_RUNTIME_DIR": str(base)}
    cli = lambda *a: subprocess.run([*CLI, *a], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)  # noqa: E731
    r = subprocess.run(
        cg.wrap([*CLI, "up", TINY, "--detach", "--port", "0", "--reserve-mb", "0"]),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    try:
        st = json.loads(cli("status", "--json").stdout)
        body = json.dumps(
            {"model": "moe-pipe-tiny", "messages": [{"role": "user", "content": "Tell a story"}], "max_tokens": 32, "temperature": 0}
        ).encode()
        req = urllib.request.Request(st["url"] + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            assert resp.status == 200
        over = {}
        for p in json.loads(cli("status", "--json").stdout)["processes"]:
            allowed = ROLE_PRIVATE_MIB[p["name"]] + VOCAB_BYTES_PER_TOKEN.get(p["name"], 0) * 2048 / MiB
            if _private_mib(p["pid"]) > allowed:
                over[p["name"]] = (round(_private_mib(p["pid"]), 1), allowed)
        assert not over, f"children over their estimate (MiB, measured vs allowed): {over}"
        assert cg.oom_kills() == 0 and (cg.path / "memory.failcnt").read_text().strip() == "0"
    finally:
        cli("down")
        shutil.rmtree(base, ignore_errors=True)


def test_the_auto_ceiling_follows_the_platform(monkeypatch):
    """cache_ceil_mb = "auto": 35 % of RAM on a phone, no ceiling elsewhere; a number applies everywhere."""
    from moe_pipe.shared.config import load_config
    from moe_pipe.shared.experts import budget as B

    assert B.platform_ceil_mb(11_300 * 10**6, phone=True) == 3771
    assert B.platform_ceil_mb(11_300 * 10**6, phone=False) == B.NO_CEIL_MB
    mem = MemoryProbe(64 * GiB, ())
    cfg = load_config(None, {"model.path": "tiny"})
    assert cfg.cache.cache_ceil_mb == "auto"
    import math
    from types import SimpleNamespace

    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=12 * GiB))
    monkeypatch.setattr(B, "on_phone", lambda: True)
    phone = B.resolve_budget(cfg, dense_bytes=GiB, kv_bytes=0, memory=mem)
    assert phone.bytes == math.floor(12 * GiB * 0.35 / MiB) * MiB and phone.clamped
    monkeypatch.setattr(B, "on_phone", lambda: False)
    board = B.resolve_budget(cfg, dense_bytes=GiB, kv_bytes=0, memory=mem)
    assert not board.clamped and board.bytes == 64 * GiB - GiB - 512 * MiB
    fixed = load_config(None, {"model.path": "tiny", "cache.cache_ceil_mb": 2000})
    assert B.resolve_budget(fixed, dense_bytes=GiB, kv_bytes=0, memory=mem).bytes == 2000 * MiB


def test_the_cache_line_names_one_cache_size_and_says_why_it_is_below_the_budget():
    from moe_pipe.procs.resources import cache_description

    b = compute_budget(64, 1e9, None, dense_bytes=0, kv_bytes=0, dense_policy="anon")
    assert b.description == "budget 64 MiB: fixed cache_mb 64"
    assert cache_description(b.description, 96, 1300) == "every expert of the model, under the budget 64 MiB: fixed cache_mb 64"
    assert cache_description(b.description, 1300, 1300) == b.description


def test_mtp_drafts_add_the_blocks_one_layer_of_kv_to_the_service(tmp_path):
    """The MTP drafter's cache is one more attention layer of ctx_size positions, counted
    only when drafts come from the block, on a file that has one, with one slot."""
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.makemodel.maker import make_model

    with open_model(make_model("qwen35moe", "tiny", tmp_path / "m.gguf", mtp=True)) as mf:
        spec = mf.spec
        base = {"compute.ctx_size": 2048, "compute.kv_type": "f16"}
        plain = service_kv_bytes(load_config(None, base), spec)
        layer = 2048 * spec.n_head_kv[-1] * (spec.head_dim_k[-1] + spec.head_dim_v[-1]) * 2
        mtp = {**base, "compute.draft": 2, "compute.draft_source": "mtp"}
        assert service_kv_bytes(load_config(None, mtp), spec) == plain + layer
        assert service_kv_bytes(load_config(None, {**mtp, "compute.draft": 0}), spec) == plain
        assert service_kv_bytes(load_config(None, {**mtp, "compute.draft_source": "ngram"}), spec) == plain
        # several slots do not draft: their pool, a whole context each here, and no drafter's layer
        two = load_config(None, {**mtp, "gateway.parallel": 2, "gateway.kv_pool": 4096})
        assert service_kv_bytes(two, spec) == kv_pool_bytes(spec, 2048, "f16", 2, 4096) < 2 * plain + 2 * MiB
