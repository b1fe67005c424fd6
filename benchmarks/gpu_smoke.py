"""GPU smoke test of the generation engines and the fsdp preset: one call on a CUDA machine with vllm installed.

    python benchmarks/gpu_smoke.py                        # bundled SmolLM2 (converted cache)
    python benchmarks/gpu_smoke.py --model-path ~/models/Qwen2.5-0.5B-Instruct --enforce-eager

Checks, each reported PASS/FAIL/SKIP (exit status 1 when any fails):
  hf_cuda          HFEngine on the GPU: responses within max_new_tokens, stop token kept, seeds reproducible
  vllm_start       VLLMEngine comes up colocated with the HF policy (sleep mode on)
  vllm_greedy      greedy responses obey the stop rules; first tokens agree with HFEngine's
  vllm_seeds       same seed, same samples; another seed, other samples
  vllm_logprobs    the engine's behaviour log-probs against the trainer's scoring of the same tokens (bf16 gap)
  sleep_update     sleep, update_weights with perturbed weights: responses change and agree with the
                   perturbed HF model (the weights landed under the right names)
  restore          update_weights with the original weights gives the original responses back
  lora_merge       a LoRA-wrapped policy (random adapters) synced through full_named_tensors agrees
                   with peft's own merge_and_unload
  throughput       vLLM and HFEngine tokens/s on one batch (reported, not checked)
  vllm_fsdp_train  `empo2 train engine=vllm engine.sleep_mode=true trainer=fsdp`: two iterations, a weight sync each
  fsdp_one_iteration  `empo2 train debug=fast trainer=fsdp`: one iteration with the FSDP2-sharded policy, bf16
                      mixed precision (the path the CPU tests run in float32 only)
  fsdp_unsharded_path the shards stay float32 DTensors and `unsharded` gathers them in bfloat16
                      (MixedPrecisionPolicy); the HF engine's generation and validation run inside it, the old
                      log-probs and the update on the sharded forward: on-policy (p=0), one sample per
                      micro-batch, the first step's ratio must be 1 and its KL 0 (to bf16 rounding), i.e. both
                      passes score the same distribution
  fsdp_master_weights the policy read in bfloat16 (`model.dtype=bfloat16`), one bf16-mixed fsdp iteration: after
                      a step every trainable shard and AdamW moment is a float32 DTensor
  vllm_tensor_parallel  (2 GPUs or more) `torchrun --nproc-per-node 2 -m empo2.cli train engine=vllm
                      engine.tensor_parallel_size=2 trainer=fsdp` on the shipped MiniSci prior (4 heads, 2 KV
                      heads: SmolLM2's 9 do not split in two): one engine sharded over both ranks, on NCCL, runs the
                      iteration's actions, tips and validation; both ranks end with the same weights and tips
  sleep_level2_sync   sleep (level 2: weights discarded, KV cache dropped) frees GPU memory, generating before
                      a sync is refused, the wake empties PyTorch's CUDA cache, and after the sync the seeded
                      samples and their log-probs are those of the engine before it slept
  engine_dtype     engine.dtype=auto is the trainer's compute precision: a float32 policy under bf16-mixed gets a
                   bfloat16 vLLM engine, under 32-true a float32 one (never the parameters' dtype)
  engine_gap       a float32 trainer's scoring against vLLM at float32 and at bfloat16 on the same prompts
                   (rollout/logprob_gap_*): the bfloat16 engine's gap is the larger; numbers reported
  engine_gap_train `empo2 train engine=vllm trainer.precision=bf16-mixed algo.tis_cap=2`: one iteration logs
                   rollout/logprob_gap_{mean,max,kl}
  launcher_two_gpus   (2+ GPUs) the plain `empo2 train trainer=fsdp trainer.devices=2 engine=vllm`, no torchrun:
                      Lightning's own launcher starts rank 1, each rank's vLLM engine on its own GPU; the ranks end
                      with the same weights (rank<r>.json)
Writes a JSON report (benchmarks/results/gpu_smoke.json unless --out is given). The whole call keeps within
--budget-s (600 s by default): a check that would start after it is recorded as SKIP, and a training command still
running at it is stopped (FAIL: it did not finish in time). Without a CUDA GPU it stops at once, in one line
(exit status 2).
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

RESULTS: list[dict] = []
DEADLINE = float("inf")  # time.monotonic() at which the --budget-s budget is spent
AGREEMENT = 0.75  # bf16 kernels differ between engines; near-ties may flip a few first tokens


def left() -> float:
    """Seconds of the budget left: the timeout of a check's training command."""
    return max(DEADLINE - time.monotonic(), 1.0)


def check(name: str):
    """Runs the decorated check at once, recording PASS (it returned details) or FAIL (it raised); SKIP where the
    budget is spent before it starts."""
    def run(fn):
        if time.monotonic() >= DEADLINE:
            RESULTS.append({"check": name, "status": "SKIP", "reason": "the --budget-s budget was spent"})
            print(f"[SKIP] {name} (budget spent)", flush=True)
            return fn
        start = time.perf_counter()
        try:
            details, status = fn() or {}, "PASS"
        except Exception as e:  # a failed check must not stop the others
            status, details = "FAIL", {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=4)}
        RESULTS.append({"check": name, "status": status, "seconds": round(time.perf_counter() - start, 2), **details})
        print(f"[{status}] {name} ({RESULTS[-1]['seconds']} s) " + json.dumps(
            {k: v for k, v in details.items() if k != "trace"})[:400], flush=True)
        return fn
    return run


def first_token_agreement(a, b) -> float:
    return sum(x.token_ids[:1] == y.token_ids[:1] for x, y in zip(a, b)) / len(a)


def exact_agreement(a, b) -> float:
    return sum(x.token_ids == y.token_ids for x, y in zip(a, b)) / len(a)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="HF checkpoint directory (default: bundled SmolLM2 cache)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--enforce-eager", action="store_true", help="skip vLLM's CUDA graphs (faster start)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu_smoke.json"))
    ap.add_argument("--budget-s", type=float, default=600.0,
                    help="the whole call's time budget in seconds; checks left when it is spent are skipped")
    args = ap.parse_args()
    # before any model or engine is loaded: a machine without a GPU learns it at once
    if not torch.cuda.is_available():
        print(f"gpu_smoke.py needs a CUDA GPU: torch {torch.__version__} sees none", file=sys.stderr)
        return 2
    global DEADLINE
    DEADLINE = time.monotonic() + args.budget_s

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from empo2.config import ModelConfig
    from empo2.models import apply_lora
    from empo2.models.io import ensure_smollm2
    from empo2.rollout.engines import HFEngine, SamplingParams, VLLMEngine, full_named_tensors
    from empo2.rollout.prompts import PromptBuilder

    path = str(Path(args.model_path).expanduser() if args.model_path else ensure_smollm2())
    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    original = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    builder = PromptBuilder(tok)
    rooms = ["the kitchen", "the hallway", "the greenhouse", "outside", "the workshop", "the bathroom"]
    prompts = []
    for i in range(16):
        turns = [(f"You are in {rooms[(i + t) % 6]}.", f"go to {rooms[(i + t + 1) % 6]}") for t in range(i % 4)]
        prompts.append(builder.build("Your task is to find an animal and focus on it.", turns,
                                     f"This room is called {rooms[i % 6]}. You see a door and a table.").ids)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=24)
    hf = HFEngine(policy, tok)
    state: dict = {}
    print(f"model {path}, {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)

    def assert_stop_rules(gens, params, stops):
        for g in gens:
            assert 0 < len(g.token_ids) <= params.max_new_tokens, g
            assert g.finished == (g.token_ids[-1] in stops), g
            assert not any(t in stops for t in g.token_ids[:-1]), g  # nothing after the first stop
            assert "\n" not in g.text, g

    @check("hf_cuda")
    def _():
        gens = hf.generate(prompts, greedy)
        assert_stop_rules(gens, greedy, hf.stops.stop_ids(True))
        assert hf.generate(prompts, sampled, seed=1) == hf.generate(prompts, sampled, seed=1)
        state["hf_greedy"] = gens
        return {"finished": sum(g.finished for g in gens), "example": gens[0].text}

    @check("vllm_start")
    def _():
        state["engine"] = VLLMEngine(policy, tok, gpu_memory_utilization=args.gpu_memory_utilization, sleep_mode=True,
                                     llm_kwargs={"enforce_eager": args.enforce_eager}, dtype=args.dtype)
        import vllm
        return {"vllm": vllm.__version__}

    engine = state.get("engine")
    if engine is None:
        for name in ("vllm_greedy", "vllm_seeds", "vllm_logprobs", "sleep_update", "restore", "lora_merge",
                     "throughput", "vllm_fsdp_train", "vllm_tensor_parallel",
                     "sleep_level2_sync", "engine_dtype", "engine_gap",
                     "engine_gap_train"):
            RESULTS.append({"check": name, "status": "SKIP", "reason": "vLLM engine did not start"})
            print(f"[SKIP] {name}")
        return report(args.out)

    @check("vllm_greedy")
    def _():
        gens = engine.generate(prompts, greedy)
        assert_stop_rules(gens, greedy, engine.stops.stop_ids(True))
        state["g0"] = gens
        agree = first_token_agreement(gens, state["hf_greedy"]) if "hf_greedy" in state else None
        assert agree is None or agree >= AGREEMENT, f"first-token agreement with HF {agree}"
        return {"first_token_agreement_with_hf": agree, "exact_agreement_with_hf":
                exact_agreement(gens, state["hf_greedy"]) if "hf_greedy" in state else None, "example": gens[0].text}

    @check("vllm_seeds")
    def _():
        a = engine.generate(prompts, sampled, seed=11)
        assert engine.generate(prompts, sampled, seed=11) == a, "same seed gave other samples"
        assert engine.generate(prompts, sampled, seed=12) != a, "another seed gave the same samples"
        assert_stop_rules(a, sampled, engine.stops.stop_ids(True))

    @check("vllm_logprobs")
    def _():
        # the engine's behaviour log-probs against the trainer's scoring of the same tokens (tests/integration/
        # test_vllm.py bounds the float32 gap on a CPU by 2e-4; in bfloat16 the two kernels differ by more)
        from empo2.config import AlgoConfig, TrainerConfig
        from empo2.lit.data import RolloutBuffer
        from empo2.lit.module import EMPO2Module
        from empo2.rollout.types import StepSample

        params = SamplingParams(temperature=1.0, max_new_tokens=24, logprobs=True)
        gens = engine.generate(prompts, params, seed=3)
        module = EMPO2Module(policy, tok, AlgoConfig(), TrainerConfig(), RolloutBuffer())
        samples = [StepSample(behaviour_ids=p, train_ids=p, response_ids=g.token_ids, memory=False, offpolicy=False,
                              group_id=0, traj_id=i, step=0) for i, (p, g) in enumerate(zip(prompts, gens))]
        gaps = torch.cat([(torch.tensor(g.logprobs) - s.float()).abs()
                          for g, s in zip(gens, module.score_behaviour(samples, 4))])
        assert float(gaps.mean()) < 0.05, f"mean |vLLM - trainer| log-prob gap {float(gaps.mean()):.4f}"
        return {"max_gap": float(gaps.max()), "mean_gap": float(gaps.mean()), "tokens": int(gaps.numel())}

    @check("sleep_update")
    def _():
        g = torch.Generator(device="cuda").manual_seed(0)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if p.dim() == 2 and "embed" not in name:
                    p.add_(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype) * p.float().std() * 0.5)
        engine.sleep()
        engine.update_weights(full_named_tensors(policy))
        gens = engine.generate(prompts, greedy)
        changed = 1 - exact_agreement(gens, state["g0"])
        agree = first_token_agreement(gens, hf.generate(prompts, greedy))
        assert changed > 0, "perturbed weights left every response unchanged"
        assert agree >= AGREEMENT, f"vLLM disagrees with the perturbed HF model ({agree}): weights misplaced"
        return {"changed_fraction": changed, "first_token_agreement_with_hf": agree}

    @check("restore")
    def _():
        policy.load_state_dict(original)
        engine.sleep()
        engine.update_weights(full_named_tensors(policy))
        same = exact_agreement(engine.generate(prompts, greedy), state["g0"])
        assert same >= AGREEMENT, f"only {same} of the original responses came back"
        return {"exact_agreement_with_original": same}

    @check("lora_merge")
    def _():
        lora_policy = apply_lora(copy.deepcopy(policy), ModelConfig(lora_r=8, lora_alpha=16))
        with torch.no_grad():
            for name, p in lora_policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.02)
        engine.update_weights(full_named_tensors(lora_policy))
        gens = engine.generate(prompts, greedy)
        merged = HFEngine(copy.deepcopy(lora_policy).merge_and_unload(), tok).generate(prompts, greedy)
        agree = first_token_agreement(gens, merged)
        assert agree >= AGREEMENT, f"vLLM disagrees with the merged LoRA model ({agree})"
        engine.update_weights(full_named_tensors(policy))
        return {"first_token_agreement_with_merged": agree, "changed_fraction": 1 - exact_agreement(gens, state["g0"])}

    @check("throughput")
    def _():
        batch = (prompts * 8)[:128]
        params = SamplingParams(temperature=1.0, max_new_tokens=32, stop_at_newline=False)
        out = {}
        for name, eng in (("vllm", engine), ("hf", hf)):
            eng.generate(batch[:8], params, seed=0)
            start = time.perf_counter()
            n = sum(len(g.token_ids) for g in eng.generate(batch, params, seed=0))
            out[f"{name}_tok_per_s"] = round(n / (time.perf_counter() - start), 1)
        return out

    @check("vllm_fsdp_train")
    def _():
        # `empo2 train engine=vllm trainer=fsdp` with sleep mode: the run the CPU tests make in float32 on gloo
        # (tests/integration/test_vllm.py), here in bf16 on NCCL with the engine releasing its memory for updates
        with tempfile.TemporaryDirectory() as root:
            cmd = [sys.executable, "-m", "empo2.cli", "train", "trainer=fsdp", "trainer.devices=1",
                   "trainer.iterations=2", "engine=vllm", "engine.sleep_mode=true", "rollout.tasks_per_batch=2",
                   "env.max_steps=4", "logger=none", f"run_root={root}", "run_name=vllm"]
            if args.model_path:
                cmd += ["model=hf", f"model.path={args.model_path}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left())
            assert proc.returncode == 0, proc.stderr[-2000:]
            summary = json.loads((Path(root) / "vllm" / "summary.json").read_text())
        syncs = [h["time/weight_sync_s"] for h in summary["history"] if "time/weight_sync_s" in h]
        assert len(syncs) == 2, summary["history"]
        return {"weight_sync_s": syncs, "total_s": summary["metrics"]["time/total_s"]}

    @check("fsdp_one_iteration")
    def _():
        # a real `empo2 train` with the fsdp preset: sharded policy, bf16 mixed precision, one iteration
        with tempfile.TemporaryDirectory() as root:
            cmd = [sys.executable, "-m", "empo2.cli", "train", "debug=fast", "trainer=fsdp", "trainer.devices=1",
                   "trainer.iterations=1", "engine=hf", f"run_root={root}", "run_name=fsdp"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left())
            assert proc.returncode == 0, proc.stderr[-2000:]
            summary = json.loads((Path(root) / "fsdp" / "summary.json").read_text())
        return {"iterations": len(summary["history"]), "strategy": summary["config"]["trainer"]["strategy"]}

    @check("fsdp_unsharded_path")
    def _():
        import lightning as L
        from torch.distributed.tensor import DTensor

        from empo2.config import load_config
        from empo2.lit.strategy import hf_model, unsharded
        from empo2.workflows.train import train

        class Probe(L.Callback):
            metrics: dict | None = None
            dtypes: dict | None = None

            def on_train_start(self, trainer, pl_module):
                shard = next(hf_model(pl_module.policy).parameters())
                with unsharded(pl_module):
                    gathered = next(hf_model(pl_module.policy).parameters())
                    self.dtypes = {"shard": str(shard.dtype), "dtensor": isinstance(shard, DTensor),
                                   "gathered": str(gathered.dtype), "gathered_dtensor": isinstance(gathered, DTensor)}

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if self.metrics is None and pl_module.last_step:  # actor/* of the first optimiser step
                    self.metrics = dict(pl_module.last_step)

        probe = Probe()
        with tempfile.TemporaryDirectory() as root:
            cfg = load_config(["debug=fast", "trainer=fsdp", "trainer.devices=1", "trainer.iterations=1",
                               "engine=hf", "algo.p=0", "trainer.micro_batch_size=1", "trainer.mini_batch_size=64",
                               "trainer.val_before_train=true", f"run_root={root}", "run_name=unsharded"])
            summary = train(cfg, callbacks=[probe])
        assert probe.dtypes == {"shard": "torch.float32", "dtensor": True, "gathered": "torch.bfloat16",
                                "gathered_dtensor": False}, probe.dtypes
        assert probe.metrics is not None, "no optimiser step ran"
        assert any("rollout/return" in h for h in summary["history"]), "no rollout inside unsharded"
        assert any("val/score_nomem" in h for h in summary["history"]), "no validation inside unsharded"
        ratio, kl = probe.metrics["actor/ratio_mean"], probe.metrics["actor/approx_kl"]
        assert abs(ratio - 1.0) < 1e-2 and kl < 1e-3, f"first-step ratio {ratio}, approx_kl {kl}"
        return {"first_step_ratio_mean": ratio, "first_step_approx_kl": kl, **probe.dtypes}

    # ------------------------------------------------------------------ float32 master weights under bf16-mixed fsdp
    @check("fsdp_master_weights")
    def _():
        # read in bfloat16 (the Qwen presets' model.dtype), trained with bf16-mixed FSDP2 on CUDA: after a step every
        # trainable shard and every AdamW moment is a float32 DTensor (bfloat16 only in the gathered compute copies)
        import lightning as L
        from torch.distributed.tensor import DTensor

        from empo2.config import load_config
        from empo2.workflows.train import train

        def kinds(tensors) -> list[str]:
            return sorted({f"{type(t).__name__} {(t.to_local() if isinstance(t, DTensor) else t).dtype}"
                           for t in tensors})

        class Probe(L.Callback):
            seen: dict | None = None

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if self.seen is None and pl_module.last_step:  # after the first optimiser step
                    optimizer = trainer.optimizers[0]
                    params = [p for p in pl_module.policy.parameters() if p.requires_grad]
                    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
                    self.seen = {"params": kinds(params), "moments": kinds(moments), "trainable": len(params),
                                 "with_state": len(optimizer.state)}

        probe = Probe()
        overrides = ["debug=fast", "trainer=fsdp", "trainer.devices=1", "trainer.iterations=1", "engine=hf",
                     "model.dtype=bfloat16"]
        if args.model_path:
            overrides += ["model=hf", f"model.path={args.model_path}"]
        with tempfile.TemporaryDirectory() as root:
            cfg = load_config(overrides + [f"run_root={root}", "run_name=master"])
            assert cfg.trainer.precision == "bf16-mixed", cfg.trainer.precision
            train(cfg, callbacks=[probe])
        seen = probe.seen
        assert seen is not None, "no optimiser step ran"
        want = ["DTensor torch.float32"]
        assert seen["params"] == want and seen["moments"] == want, seen
        assert seen["with_state"] == seen["trainable"], seen
        return seen
    # ------------------------------------------------------------------------------ tensor parallelism
    def tensor_parallel():
        with tempfile.TemporaryDirectory() as root:
            cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2", "-m", "empo2.cli", "train",
                   "model=minisci_tips_signed", "engine=vllm", "engine.tensor_parallel_size=2",
                   "engine.max_model_len=4096", "trainer=fsdp",
                   "trainer.devices=2", "trainer.iterations=1", "rollout.tasks_per_batch=2", "rollout.group_size=2",
                   "env.max_steps=3", "env.val_variations=1", "logger=none", f"run_root={root}", "run_name=tp"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left())
            assert proc.returncode == 0, proc.stderr[-2000:]
            r0, r1 = (json.loads((Path(root) / "tp" / f"rank{r}.json").read_text()) for r in (0, 1))
            summary = json.loads((Path(root) / "tp" / "summary.json").read_text())
        assert r0["weights_sha256"] == r1["weights_sha256"], "the ranks ended with different weights"
        assert r0["memory_records"] == r1["memory_records"] and r0["memory_records"], "no tips, or different ones"
        return {"tips": len(r0["memory_records"]), "val_score": summary["metrics"].get("val/score_nomem"),
                "total_s": summary["metrics"]["time/total_s"]}

    if torch.cuda.device_count() >= 2:
        check("vllm_tensor_parallel")(tensor_parallel)
    else:
        RESULTS.append({"check": "vllm_tensor_parallel", "status": "SKIP", "reason": "tensor parallelism needs 2 GPUs"})
        print("[SKIP] vllm_tensor_parallel (one GPU)")

    # ------------------------------------------------------------------------- GPU memory: sleep level 2
    @check("sleep_level2_sync")
    def _():
        # the policy holds its original weights again (`restore`); a sync resets the prefix cache, so both
        # generations below prefill from an empty cache
        params = SamplingParams(temperature=1.0, max_new_tokens=24, logprobs=True)
        engine.update_weights(full_named_tensors(policy))
        awake = engine.generate(prompts, params, seed=5)
        free_awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        freed = torch.cuda.mem_get_info()[0] - free_awake
        try:
            engine.generate(prompts, params, seed=5)
            refused = False
        except RuntimeError:
            refused = True
        planted = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")  # freed into PyTorch's cache, not the device
        del planted
        cached = torch.cuda.memory_reserved()
        engine.update_weights(full_named_tensors(policy))
        emptied = cached - torch.cuda.memory_reserved()
        again = engine.generate(prompts, params, seed=5)
        gap = max(abs(a - b) for x, y in zip(awake, again) for a, b in zip(x.logprobs, y.logprobs))
        assert freed > 0, f"sleep freed {freed} bytes"
        assert refused, "the engine generated with discarded weights"
        assert emptied >= 1 << 30, f"the wake left {cached - emptied} bytes in PyTorch's cache"
        assert [g.token_ids for g in again] == [g.token_ids for g in awake], "other responses after sleep and sync"
        assert gap < 1e-3, f"log-probs after sleep and sync differ by {gap}"
        return {"freed_gib": round(freed / (1 << 30), 3), "cache_emptied_gib": round(emptied / (1 << 30), 3),
                "max_logprob_gap": gap}
    # ---------------------------------------------------------------------------------------------------------------
    # Engine precision and the sampler/trainer gap (engine.dtype, rollout/logprob_gap_*, algo.tis_cap)
    # ---------------------------------------------------------------------------------------------------------------
    engine.sleep()  # the checks below start engines of their own
    fp32_policy = copy.deepcopy(policy).float()

    def gap_engine(dtype: str):
        return VLLMEngine(fp32_policy, tok, gpu_memory_utilization=args.gpu_memory_utilization / 2, dtype=dtype,
                          llm_kwargs={"enforce_eager": args.enforce_eager})

    def close(eng) -> None:
        eng.llm = None  # vLLM frees its memory with the last reference
        import gc
        gc.collect()
        torch.cuda.empty_cache()

    @check("engine_dtype")
    def _():
        from empo2.config import load_config
        from empo2.rollout.build import engine_dtype

        resolved = {p: engine_dtype(load_config([f"trainer.precision={p}", "model.dtype=float32"]))
                    for p in ("bf16-mixed", "32-true")}
        assert resolved == {"bf16-mixed": "bfloat16", "32-true": "float32"}, resolved
        eng = gap_engine(resolved["bf16-mixed"])
        try:
            built = eng.llm.llm_engine.model_config.dtype
            assert built == torch.bfloat16, f"a bf16-mixed run's engine computes in {built}"
        finally:
            close(eng)
        return {"resolved": resolved, "vllm_dtype": str(built)}

    @check("engine_gap")
    def _():
        from empo2.algo.core_algos import logprob_gap
        from empo2.config import AlgoConfig, TrainerConfig
        from empo2.lit.data import RolloutBuffer
        from empo2.lit.module import EMPO2Module
        from empo2.rollout.types import StepSample

        params = SamplingParams(temperature=1.0, max_new_tokens=24, logprobs=True)
        # 32-true scoring; `.to` tells the LightningModule where its policy lives (it assumes the CPU otherwise)
        module = EMPO2Module(fp32_policy, tok, AlgoConfig(), TrainerConfig(), RolloutBuffer()).to(fp32_policy.device)
        gaps = {}
        for dtype in ("float32", "bfloat16"):
            eng = gap_engine(dtype)
            try:
                gens = eng.generate(prompts, params, seed=3)
            finally:
                close(eng)
            samples = [StepSample(behaviour_ids=p, train_ids=p, response_ids=g.token_ids, memory=False,
                                  offpolicy=False, group_id=0, traj_id=i, step=0)
                       for i, (p, g) in enumerate(zip(prompts, gens))]
            gaps[dtype] = logprob_gap(torch.cat([s.float() for s in module.score_behaviour(samples, 4)]),
                                      torch.cat([torch.tensor(g.logprobs) for g in gens]))
        assert gaps["bfloat16"]["mean"] > gaps["float32"]["mean"], gaps
        return {"gap": gaps}

    @check("engine_gap_train")
    def _():
        with tempfile.TemporaryDirectory() as root:
            cmd = [sys.executable, "-m", "empo2.cli", "train", "trainer=gpu", "trainer.precision=bf16-mixed",
                   "model.dtype=float32", "trainer.iterations=1", "engine=vllm", "algo.tis_cap=2",
                   "rollout.tasks_per_batch=2", "env.max_steps=4", "env.val_variations=1", "logger=none",
                   f"run_root={root}", "run_name=gap"]
            if args.model_path:
                cmd += ["model=hf", f"model.path={args.model_path}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left())
            assert proc.returncode == 0, proc.stderr[-2000:]
            summary = json.loads((Path(root) / "gap" / "summary.json").read_text())
        gap = {k: v for k, v in summary["history"][0].items() if k.startswith("rollout/logprob_gap_")}
        assert set(gap) == {f"rollout/logprob_gap_{k}" for k in ("mean", "max", "kl")}, summary["history"][0]
        return gap

    # ------------------------------------------------------------------ launchers: every one starts multi-process vLLM
    if torch.cuda.device_count() < 2:
        RESULTS.append({"check": "launcher_two_gpus", "status": "SKIP", "reason": "fewer than 2 GPUs"})
        print("[SKIP] launcher_two_gpus (fewer than 2 GPUs)")
    else:
        @check("launcher_two_gpus")
        def _():
            # what `empo2 train experiment=empo2_paper` does on a multi-GPU node (trainer=fsdp has devices: auto):
            # Lightning's launcher sets no RANK for the rank it starts; the run exports it before the engine reads it
            with tempfile.TemporaryDirectory() as root:
                cmd = [sys.executable, "-m", "empo2.cli", "train", "trainer=fsdp", "trainer.devices=2",
                       "trainer.iterations=1", "engine=vllm", "rollout.tasks_per_batch=2", "env.max_steps=4",
                       "logger=none", f"run_root={root}"]
                if args.model_path:
                    cmd += ["model=hf", f"model.path={args.model_path}"]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left())
                assert proc.returncode == 0, proc.stderr[-2000:]
                ranks = [json.loads(p.read_text()) for p in sorted(Path(root).glob("*/rank*.json"))]
            assert len(ranks) == 2, f"{len(ranks)} rank files"
            assert ranks[0]["weights_sha256"] == ranks[1]["weights_sha256"], "the ranks ended with other weights"
            return {"ranks": len(ranks)}

    return report(args.out)


def report(path: str) -> int:
    failed = [r["check"] for r in RESULTS if r["status"] == "FAIL"]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"results": RESULTS, "failed": failed}, indent=2, default=str))
    print(f"\n{len(RESULTS) - len(failed)}/{len(RESULTS)} checks without failure; report: {out}")
    for r in RESULTS:
        if r["status"] == "FAIL":
            print(f"--- {r['check']}\n{r.get('trace', r.get('error'))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
