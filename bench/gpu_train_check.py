#!/usr/bin/env python3
"""Training on the GPU, kind by kind: scripts/gpu-check's last stage.

    python3 bench/gpu_train_check.py --depthkit build-gpu/depthkit --out DIR [--corpus DIR]

The kinds (default residual, attnres, dar, msar, mhc: the block forms, S = 4, of
configs/gpu-check.toml, the DAR paper's 0.1B width) with train.device = cuda and train.dtype =
bfloat16: `depthkit cost` gives each kind's training FLOPs per token; `depthkit bench` times all
of them interleaved on random tokens (median step time, tokens/s, overhead against residual, each
kind's peak CUDA memory from the caching allocator), whence MFU = tokens/s x FLOPs per token / the
H200's dense bf16 peak; then each kind, in its own process under a time limit, trains for 30 steps
on the corpus, logging every step: "loss fell" = its last logged loss is below its first.

A kind that fails is recorded with its exit status and the last error line of its output, and the
others still run. If the interleaved bench fails, each kind is timed beside residual alone. An
operator without a kernel on the device runs its reference composition (the library chooses, per
operator, and says so on stderr); each kind's entry lists those operators, read from its own
training run. DIR/gpu_check.json is rewritten after every stage, so that a run stopped at any
point leaves what it had; it also takes in the kernel check (DIR/gpu_ops.json, bench/gpu_ops.py)
and the build stages scripts/gpu-check recorded (--stages).

Only the Python standard library is needed. --device cpu, --dtype '' and a small --config run the
same code paths on a machine without a GPU (how it is tested).
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

# NVIDIA H200 SXM datasheet: BF16 tensor core 1,979 TFLOPS "with sparsity"; dense is half of it.
H200_BF16_DENSE_PEAK_FLOPS = 989.4e12
PEAK_SOURCE = ("NVIDIA H200 SXM datasheet, BF16 tensor core: 1,979 TFLOPS with 2:4 sparsity, "
               "989.4 TFLOPS dense")
FLOPS_NOTE = ("training FLOPs per token from `depthkit cost --json`: backbone (projections, causal "
              "attention, LM head) + pathway, each counted as 3x the forward (multiply-add = 2)")
# What the library prints, once per process and operator, when an operator has no kernel on the
# model's device and runs its reference composition instead (src/depthkit/ops/kernel_choice.cpp).
REFERENCE_OPERATOR = re.compile(r"^depthkit: (\w+) has no \w+ kernel; running its reference composition",
                                re.MULTILINE)


class Outcome:
    """A finished (or killed) command: exit status, output, seconds, and why it failed."""

    def __init__(self, cmd, returncode, stdout, stderr, seconds, timeout=None, error=None):
        self.cmd, self.returncode, self.stdout, self.stderr = cmd, returncode, stdout, stderr
        self.seconds, self.timeout, self.error = seconds, timeout, error

    @property
    def ok(self):
        return self.returncode == 0 and self.error is None

    def why(self):
        """One line: how the command ended and its last error line."""
        if self.error:
            return self.error
        if self.returncode is None:
            how = f"timed out after {self.timeout:.0f} s"
        elif self.returncode < 0:
            how = f"killed by signal {-self.returncode}"
        else:
            how = f"exit {self.returncode}"
        line = last_error_line(self.stderr) or last_error_line(self.stdout)
        return f"{how}: {line}" if line else how

    def tail(self, lines=15):
        return (self.stderr or "").strip().splitlines()[-lines:]


def text(data):
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def last_error_line(output):
    """The program's own error line ("depthkit: error: ..."), else its last non-empty line."""
    lines = [ln.strip() for ln in text(output).replace("\r", "\n").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or [""])[-1][:400]


def run(cmd, timeout):
    """Runs cmd with a time limit (it is killed at the limit); never raises."""
    cmd = [str(c) for c in cmd]
    print("  $ " + " ".join(cmd), flush=True)
    start = time.monotonic()
    if timeout <= 0:
        return Outcome(cmd, None, "", "", 0.0, error="skipped: the time budget is spent")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout)
        return Outcome(cmd, p.returncode, p.stdout, p.stderr, time.monotonic() - start)
    except subprocess.TimeoutExpired as e:
        return Outcome(cmd, None, text(e.stdout), text(e.stderr), time.monotonic() - start, timeout=timeout)
    except OSError as e:  # the program is missing or not executable
        return Outcome(cmd, None, "", "", time.monotonic() - start, error=f"could not run {cmd[0]}: {e}")


def reference_operators(stderr):
    """The operators a run said it ran as their reference composition, in order, once each."""
    return list(dict.fromkeys(REFERENCE_OPERATOR.findall(text(stderr))))


def read_losses(metrics_path):
    losses = []
    try:
        with open(metrics_path) as fh:
            for line in fh:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict) and isinstance(row.get("loss"), (int, float)):
                    losses.append(float(row["loss"]))
    except OSError:
        pass
    return losses


def parse_stages(path):
    """scripts/gpu-check's stage records: name TAB status TAB seconds TAB message, one a line."""
    stages = []
    if not path or not os.path.exists(path):
        return stages
    with open(path) as fh:
        for line in fh:
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 3:
                continue
            try:
                seconds = float(parts[2])
            except ValueError:
                seconds = None
            stages.append({"stage": parts[0], "status": parts[1], "seconds": seconds,
                           "message": parts[3] if len(parts) > 3 else ""})
    return stages


def kernel_summary(path):
    """bench/gpu_ops.py's gpu_ops.json, with which rows failed."""
    if not os.path.exists(path):
        return {"ok": False, "error": f"no {os.path.basename(path)}: the kernel check did not finish (see stages)"}
    try:
        with open(path) as fh:
            ops = json.load(fh)
    except (OSError, ValueError) as e:
        return {"ok": False, "error": f"{path}: {e}"}
    parity = ops.get("parity", [])
    failed = [r for r in parity if r.get("status") not in ("ok", "no CUDA kernel")]
    checked = sorted({r["op"] for r in parity if r.get("status") == "ok"})
    unchecked = ops.get("unchecked_cuda_kernels") or []
    return {"ok": not failed and bool(checked) and not unchecked, "device": ops.get("device"),
            "torch": ops.get("torch"), "checked_ops": checked, "failed": failed, "parity": parity,
            "bandwidth": ops.get("bandwidth", []),
            "cuda_kernels": ops.get("cuda_kernels"), "unchecked_cuda_kernels": unchecked,
            "no_cuda_kernel": ops.get("no_cuda_kernel")}


class Check:
    def __init__(self, a):
        self.a = a
        self.out = Path(a.out)
        self.work = Path(a.work)
        self.deadline = a.deadline if a.deadline else time.time() + a.budget
        self.started = time.time()
        with open(a.config, "rb") as fh:
            self.config = tomllib.load(fh)
        for override in a.set:  # as depthkit applies them: the value is TOML, a bare word a string
            key, _, value = override.partition("=")
            section, _, name = key.partition(".")
            try:
                value = tomllib.loads(f"v = {value}")["v"]
            except tomllib.TOMLDecodeError:
                pass
            self.config.setdefault(section, {})[name] = value
        self.kinds = [k for k in a.kinds.split(",") if k]
        if "residual" in self.kinds:  # the baseline runs first: overheads are against it
            self.kinds.remove("residual")
            self.kinds.insert(0, "residual")
        self.device_sets = [f"train.device={a.device}"] + ([f"train.dtype={a.dtype}"] if a.dtype else [])
        # reference_operators stays None until the kind's training has run: unknown, not "none".
        self.entries = {k: {"kind": k, "ok": False, "error": None, "reference_operators": None,
                            "tokens_per_s": None, "median_step_s": None, "peak_bytes": None,
                            "peak_bytes_source": None, "overhead_vs_residual": None, "flops_per_token": None,
                            "mfu": None, "loss_first": None, "loss_last": None, "loss_fell": None,
                            "train_steps_logged": 0, "train_seconds": None, "train_tokens_per_s": None,
                            "train_error": None, "bench_error": None, "cost_error": None,
                            "train_stderr_tail": []}
                        for k in self.kinds}
        self.data = {"status": "not run"}
        self.bench_runs = []
        # DAR again with its parameters and gradients sharded (ZeRO-3: hooks, buckets, reduce-scatter,
        # each branch gathered around its use, the next one prefetched) and its branches
        # recomputed, on one device: the same losses as the plain run (issue 34's check).
        self.sharded = {"status": "not run", "sets": ["train.zero=3", "train.recompute=branch"]}

    def left(self, want):
        """Seconds a stage may take: `want`, or what is left of the budget."""
        return max(0.0, min(want, self.deadline - time.time()))

    # --- the summary ---------------------------------------------------------------------------

    def summary(self):
        m = self.config.get("model", {})
        t = self.config.get("train", {})
        stages = parse_stages(self.a.stages)
        kernels = kernel_summary(str(self.out / "gpu_ops.json")) if not self.a.no_kernels else None
        entries = [self.entries[k] for k in self.kinds]
        failed = [e["kind"] for e in entries if not e["ok"]]
        failed_stages = [s["stage"] for s in stages if s["status"] == "failed"]
        if kernels is not None and not kernels["ok"] and "kernels" not in failed_stages:
            failed_stages.append("kernels")
        ok = not failed and not failed_stages and self.sharded["status"] in ("ok", "not run")
        return {
            "ok": ok,
            "failed_kinds": failed,
            "failed_stages": failed_stages,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
            "seconds": round(time.time() - self.started, 1),
            "device": self.a.device,
            "device_name": (kernels or {}).get("device"),
            "dtype": self.a.dtype or None,
            "config": {"path": self.a.config, "overrides": self.device_sets + self.a.set,
                       "n_layers": m.get("n_layers"), "d_model": m.get("d_model"), "n_heads": m.get("n_heads"),
                       "d_ff": m.get("d_ff"), "vocab_size": m.get("vocab_size"), "seq_len": m.get("seq_len"),
                       "block_sublayers": self.config.get("residual", {}).get("block_sublayers"),
                       "impl": self.config.get("residual", {}).get("impl", "fused"),
                       "micro_batch": t.get("micro_batch"), "grad_accum": t.get("grad_accum", 1),
                       "train_steps": self.a.steps, "bench_steps": self.a.bench_steps,
                       "bench_warmup": self.a.bench_warmup},
            "peak_flops": self.a.peak_flops,
            "peak_flops_source": PEAK_SOURCE,
            "flops_note": FLOPS_NOTE,
            "mfu_note": "tokens_per_s (interleaved bench, median step) x flops_per_token / peak_flops",
            "stages": stages,
            "kernels": kernels,
            "data": self.data,
            "bench_runs": self.bench_runs,
            "kinds": entries,
            "sharded": self.sharded,
        }

    def write(self):
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "gpu_check.json"
        tmp = path.with_suffix(".json.tmp")
        with open(tmp, "w") as fh:
            json.dump(self.summary(), fh, indent=1)
            fh.write("\n")
        os.replace(tmp, path)

    # --- the stages ------------------------------------------------------------------------------

    def prepare_data(self):
        """Token shards of the corpus with the config's vocabulary, made once and reused."""
        vocab = self.config.get("model", {}).get("vocab_size")
        data = Path(self.a.data) if self.a.data else self.work / "data"
        meta = data / "meta.json"
        try:
            with open(meta) as fh:
                if json.load(fh).get("vocab_size") == vocab:
                    self.data = {"status": "ok", "dir": str(data), "reused": True}
                    return str(data)
        except (OSError, ValueError):
            pass
        if self.a.data:
            self.data = {"status": "failed", "dir": str(data), "error": f"{meta}: missing or not vocabulary {vocab}"}
            return None
        if not self.a.corpus or not os.path.isdir(self.a.corpus):
            self.data = {"status": "failed", "error": f"no corpus directory '{self.a.corpus}' (scripts/gpu-check "
                                                      "--debs with python3.11-doc, or --corpus)"}
            return None
        print(f"gpu_train_check: preparing {data} from {self.a.corpus} (vocabulary {vocab})", flush=True)
        r = run([self.a.depthkit, "data", "prepare", "--input", self.a.corpus, "--out", data, "--vocab-size", vocab,
                 "--val-fraction", "0.05", "--seed", "42", "--force"], self.left(self.a.prepare_timeout))
        self.data = {"status": "ok" if r.ok else "failed", "dir": str(data), "seconds": round(r.seconds, 1),
                     "error": None if r.ok else r.why()}
        return str(data) if r.ok else None

    def train(self, kind, data_dir):
        e = self.entries[kind]
        if data_dir is None:
            e["train_error"] = f"no training data: {self.data.get('error')}"
            return
        run_dir = self.work / "runs" / kind
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run (this script's own directory)
        cmd = [self.a.depthkit, "train", "--config", self.a.config, "--run-dir", run_dir]
        for s in [f"residual.kind={kind}", f"data.dir={data_dir}", f"train.steps={self.a.steps}",
                  "train.log_every=1"] + self.device_sets + self.a.set:
            cmd += ["--set", s]
        r = run(cmd, self.left(self.a.kind_timeout))
        e["train_seconds"] = round(r.seconds, 1)
        e["train_stderr_tail"] = r.tail()
        # From this kind's own process: the interleaved bench builds every kind in one process, whose
        # lines (once per operator) cannot be told apart by kind. The bench runs the same operators
        # (same config, kind and device), so the list holds for its timings too.
        # (None where it never started: skipped for time, or the program could not run.)
        e["reference_operators"] = None if r.error else reference_operators(r.stderr)
        if not r.ok:
            e["train_error"] = r.why()
            return
        losses = read_losses(run_dir / "metrics.jsonl")
        e["train_steps_logged"] = len(losses)
        if losses:
            e["loss_first"], e["loss_last"] = losses[0], losses[-1]
            e["loss_fell"] = losses[-1] < losses[0]
        try:
            with open(run_dir / "summary.json") as fh:
                s = json.load(fh)
            e["train_tokens_per_s"] = s.get("tokens_per_s")
            # Whatever the trainer reports of memory (CPU tensors, and the device's where it says).
            e["train_summary"] = {k: v for k, v in s.items() if isinstance(v, (int, float, str))}
        except (OSError, ValueError):
            pass
        # The final checkpoint (GBs at this size) is not needed: the metrics are read.
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)

    def train_sharded(self, data_dir):
        """DAR with train.zero = 3 and train.recompute = branch against its plain run: per-step losses."""
        plain = self.entries.get("dar")
        if plain is None or not plain["ok"] or data_dir is None:
            self.sharded.update(status="skipped", error="needs dar trained first")
            return
        run_dir = self.work / "runs" / "dar-sharded"
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [self.a.depthkit, "train", "--config", self.a.config, "--run-dir", run_dir]
        for s in ["residual.kind=dar", f"data.dir={data_dir}", f"train.steps={self.a.steps}", "train.log_every=1"] + \
                self.device_sets + self.a.set + self.sharded["sets"]:
            cmd += ["--set", s]
        r = run(cmd, self.left(self.a.kind_timeout))
        self.sharded["seconds"] = round(r.seconds, 1)
        if not r.ok:
            self.sharded.update(status="failed", error=r.why(), stderr_tail=r.tail())
            return
        mine, theirs = read_losses(run_dir / "metrics.jsonl"), read_losses(self.work / "runs" / "dar" / "metrics.jsonl")
        worst = max((abs(a - b) / abs(b) for a, b in zip(mine, theirs)), default=None)
        self.sharded["loss_max_relative_difference"] = worst
        try:
            with open(run_dir / "summary.json") as fh:
                summary = json.load(fh)
            self.sharded["summary"] = {k: v for k, v in summary.items() if isinstance(v, (int, float, str))}
        except (OSError, ValueError):
            pass
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        # bf16 on a GPU: kernels may sum in another order run to run; 1e-2 is far below what a
        # wrong gradient does in 30 steps, and the CPU test holds it to 0.
        if len(mine) != len(theirs) or worst is None or worst > 1e-2:
            self.sharded.update(status="failed", error=f"losses differ from dar's plain run by {worst} (relative)")
        else:
            self.sharded.update(status="ok", error=None)

    def cost(self, kind):
        e = self.entries[kind]
        cmd = [self.a.depthkit, "cost", "--config", self.a.config, "--json"]
        for s in [f"residual.kind={kind}"] + self.a.set:
            cmd += ["--set", s]
        r = run(cmd, self.left(60))
        if not r.ok:
            e["cost_error"] = r.why()
            return
        try:
            flops = json.loads(r.stdout)["training_flops_per_token"]
            e["flops_per_token"] = float(flops["backbone"]) + float(flops["pathway"])
        except (ValueError, KeyError, TypeError) as err:
            e["cost_error"] = f"unreadable `depthkit cost --json` output: {err}"

    def bench(self, kinds):
        """One interleaved `depthkit bench`; its runs, or None with the failure recorded."""
        cmd = [self.a.depthkit, "bench", "--config", self.a.config, "--kinds", ",".join(kinds), "--steps",
               self.a.bench_steps, "--warmup", self.a.bench_warmup, "--json"]
        for s in self.device_sets + self.a.set:
            cmd += ["--set", s]
        r = run(cmd, self.left(self.a.bench_timeout))
        # All the kinds' operators together: one process says once per operator.
        record = {"kinds": kinds, "seconds": round(r.seconds, 1), "ok": r.ok, "error": None if r.ok else r.why(),
                  "reference_operators": reference_operators(r.stderr)}
        self.bench_runs.append(record)
        if not r.ok:
            return None
        for line in reversed(r.stdout.strip().splitlines()):
            try:
                runs = json.loads(line)["runs"]
                break
            except (ValueError, KeyError, TypeError):
                continue
        else:
            record.update(ok=False, error="no JSON with 'runs' in the output of depthkit bench --json")
            return None
        return runs

    def take_bench(self, runs):
        base = next((r for r in runs if r["kind"] == "residual"), None)
        for r in runs:
            e = self.entries[r["kind"]]
            if e["tokens_per_s"] is not None:  # already measured (residual, in an earlier group)
                continue
            e["tokens_per_s"] = r["tokens_per_s"]
            e["median_step_s"] = r["median_step_s"]
            if r.get("peak_device_bytes") is not None:
                e["peak_bytes"], e["peak_bytes_source"] = r["peak_device_bytes"], "cuda caching allocator"
            else:
                e["peak_bytes"], e["peak_bytes_source"] = r.get("peak_tensor_bytes"), "cpu tensors"
            if base is not None:
                e["overhead_vs_residual"] = r["median_step_s"] / base["median_step_s"] - 1.0
            e["bench_error"] = None

    def bench_all(self):
        """All kinds interleaved in one `depthkit bench`. If that fails, each kind is timed beside
        residual alone, so that one kind's failure leaves the others measured."""
        runs = self.bench(self.kinds)
        if runs is not None:
            self.take_bench(runs)
            return
        error = self.bench_runs[-1]["error"]
        for k in self.kinds:
            self.entries[k]["bench_error"] = error
        if len(self.kinds) == 1:
            return
        self.write()
        baseline = ["residual"] if "residual" in self.kinds else []
        for k in [k for k in self.kinds if k != "residual"] + baseline:
            if self.entries[k]["tokens_per_s"] is not None:  # residual, measured in an earlier pair
                continue
            kinds = baseline + [k] if k != "residual" else [k]
            runs = self.bench(kinds)
            if runs is not None:
                self.take_bench(runs)
            else:
                self.entries[k]["bench_error"] = self.bench_runs[-1]["error"]
            self.write()

    def finish_entries(self):
        for e in self.entries.values():
            if e["tokens_per_s"] is not None and e["flops_per_token"] is not None:
                e["mfu"] = e["tokens_per_s"] * e["flops_per_token"] / self.a.peak_flops
            reasons = {}  # message -> the stages that gave it (a bad kind fails all three alike)
            if e["train_error"]:
                reasons.setdefault(e["train_error"], []).append("train")
            elif e["train_seconds"] is None:
                reasons.setdefault("not run (the check stopped before it)", []).append("train")
            elif e["loss_fell"] is None:
                reasons.setdefault("no loss logged in metrics.jsonl", []).append("train")
            elif not e["loss_fell"]:
                reasons.setdefault(f"loss did not fall: first {e['loss_first']:.4f}, last {e['loss_last']:.4f}",
                                   []).append("train")
            for stage in ("bench", "cost"):
                if e[f"{stage}_error"]:
                    reasons.setdefault(e[f"{stage}_error"], []).append(stage)
            e["error"] = "; ".join(f"{', '.join(stages)}: {msg}" for msg, stages in reasons.items()) or None
            e["ok"] = not reasons

    def main(self):
        self.write()
        if not os.access(self.a.depthkit, os.X_OK):
            for e in self.entries.values():
                e["train_error"] = f"no depthkit program at {self.a.depthkit} (see stages)"
            self.finish_entries()
            self.write()
            return
        # The timings first: they need no data, and a training that runs slow (or hangs until its
        # limit) must not leave the bench without time.
        for k in self.kinds:
            self.cost(k)
        print(f"gpu_train_check: timing {','.join(self.kinds)} interleaved on {self.a.device}", flush=True)
        self.bench_all()
        self.finish_entries()
        self.write()
        data_dir = self.prepare_data()
        self.write()
        for k in self.kinds:
            print(f"gpu_train_check: training {k} for {self.a.steps} steps on {self.a.device}", flush=True)
            self.train(k, data_dir)
            self.finish_entries()
            self.write()
        if "dar" in self.kinds:
            print(f"gpu_train_check: dar again with {', '.join(self.sharded['sets'])}", flush=True)
            self.train_sharded(data_dir)
            self.write()


def cell(value, width, spec, scale=1.0, unit=""):
    """A right-aligned table cell; '-' for a value not measured."""
    return format("-" if value is None else format(value * scale, spec) + unit, f">{width}")


def print_table(s):
    c = s["config"]
    print(f"\n{s['device_name'] or s['device']}, dtype {s['dtype'] or 'as configured'}: {c['n_layers']} layers, "
          f"d {c['d_model']}, T {c['seq_len']}, {c['micro_batch']} sequences a step, impl {c['impl']}; "
          f"MFU against {s['peak_flops'] / 1e12:.1f} TFLOP/s")
    print(f"{'kind':10} {'ok':3} {'tokens/s':>10} {'step ms':>8} {'overhead':>9} {'peak GiB':>9} "
          f"{'MFU':>6} {'loss first -> last':>18}  error")
    for e in s["kinds"]:
        loss = f"{e['loss_first']:.3f} -> {e['loss_last']:.3f}" if e["loss_first"] is not None else "-"
        print(f"{e['kind']:10} {'yes' if e['ok'] else 'NO':3} "
              f"{cell(e['tokens_per_s'], 10, '.0f')} {cell(e['median_step_s'], 8, '.1f', 1e3)} "
              f"{cell(e['overhead_vs_residual'], 9, '+.1f', 100, '%')} {cell(e['peak_bytes'], 9, '.2f', 1 / 2**30)} "
              f"{cell(e['mfu'], 6, '.1f', 100, '%')} {loss:>18}  {e['error'] or ''}")
    for e in s["kinds"]:
        if e["reference_operators"]:
            print(f"{e['kind']}: reference composition (no kernel on {s['device']}) for "
                  f"{', '.join(e['reference_operators'])}")
    k = s["kernels"]
    if k is not None:
        detail = k.get("error") or (f"{len(k['checked_ops'])} ops checked, {len(k['failed'])} rows failed")
        print(f"kernel check: {'ok' if k['ok'] else 'FAILED'} ({detail})")
    for st in s["stages"]:
        if st["status"] != "ok":
            print(f"stage {st['stage']}: {st['status']}: {st['message']}")
    sh = s["sharded"]
    if sh["status"] != "not run":
        print(f"dar with {', '.join(sh['sets'])}: {sh['status']}"
              + (f", losses within {sh['loss_max_relative_difference']:.2e} of the plain run"
                 if sh.get("loss_max_relative_difference") is not None else "")
              + (f" ({sh['error']})" if sh.get("error") else ""))
    print(f"gpu-check: {'all passed' if s['ok'] else 'FAILED'} in {s['seconds']:.0f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depthkit", required=True, help="the depthkit program")
    ap.add_argument("--out", required=True, help="writes gpu_check.json here (and reads gpu_ops.json)")
    ap.add_argument("--work", default="build-gpu/gpu-check", help="run directories and prepared data")
    ap.add_argument("--corpus", help="text to prepare the data from (the Python 3.11 documentation sources)")
    ap.add_argument("--data", help="already prepared data (instead of --corpus)")
    ap.add_argument("--config", default="configs/gpu-check.toml")
    ap.add_argument("--kinds", default="residual,attnres,dar,msar,mhc")
    ap.add_argument("--steps", type=int, default=30, help="training steps per kind")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="train.dtype ('' leaves the config's)")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE for every depthkit command")
    ap.add_argument("--bench-steps", type=int, default=10)
    ap.add_argument("--bench-warmup", type=int, default=3)
    ap.add_argument("--kind-timeout", type=float, default=90, help="seconds for one kind's training")
    ap.add_argument("--bench-timeout", type=float, default=150, help="seconds for one depthkit bench")
    ap.add_argument("--prepare-timeout", type=float, default=120, help="seconds for data prepare")
    ap.add_argument("--budget", type=float, default=420, help="seconds for everything (unless --deadline)")
    ap.add_argument("--deadline", type=float, help="stop starting work at this Unix time")
    ap.add_argument("--peak-flops", type=float, default=H200_BF16_DENSE_PEAK_FLOPS)
    ap.add_argument("--stages", help="scripts/gpu-check's stage records to include")
    ap.add_argument("--no-kernels", action="store_true", help="no kernel check to report (only this stage)")
    a = ap.parse_args()
    # A timeout's SIGTERM ends the program through the `finally` below (the summary is written)
    # and through subprocess.run, which kills the command in progress.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    check = Check(a)
    try:
        check.main()
    finally:  # even when interrupted: what was measured so far
        check.finish_entries()
        check.write()
        summary = check.summary()
        print_table(summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
