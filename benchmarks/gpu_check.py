"""One prepared command for a lent GPU machine: install what its image lacks from carried wheels, then measure,
within a time budget, what was built without a GPU, and write one JSON and one table.

    make gpu-wheels                          # here (network): the wheels the image lacks, in .gpu/whl
    bash benchmarks/gpu_check.sh             # there (device tool, carry [".gpu"]): results under $OUT
    bash benchmarks/gpu_check.sh --dry-run   # here: the same steps at tiny sizes on the CPU (a test runs it)

The steps, in order; each runs in its own process with a time limit, and one that fails is recorded while
the next still runs:

1. ``install``: the carried wheels into a private directory (no network, no dependencies resolved, never a
   torch: the image's CUDA build stays), once per machine; the dry run checks that every package the GPU run
   carries is installed here, at the version ``make gpu-wheels`` would fetch.
2. ``environment``: torch, the device, the versions of the packages a run imports, whether vLLM is there.
3. ``throughput``: packed SFT of a 1.1B LLaMA at 8K tokens (``gpu_throughput.py``) against the bf16 bare
   loop: posttrain packed, with ``model.compile``, and with ``model.fp8: tensorwise`` compiled; each mode's
   memory plan beside its measured peak.
4. ``tests``: ``tests/gpu``, fastest files first, a time limit per test.
5. ``vllm``: GRPO with ``use_vllm`` runs in ``tests/gpu/test_grpo_gpu.py`` when the image has vLLM; when it
   does not, this step says so (vLLM's wheel is far over the 64 MiB that travels to the machine).
6. ``report``: ``results.json`` and ``table.md`` under the output folder, the goals checked (on a GPU):
   packed >= 0.95x the bare loop, compile >= 1.05x, fp8 with compile >= 1.2x compile, each plan within 20% of
   its measured peak.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: what the GPU image lacks, or holds at a version posttrain was not tested with (the image has torch, numpy,
#: pandas, pyarrow, tokenizers, safetensors, huggingface-hub, accelerate, rich, pytest...: see
#: /work/.library/device/KINDS.md); deepspeed ships no wheel, so ``make gpu-wheels`` builds its pure-Python one
WHEELS = (
    "transformers",
    "datasets",
    "dill",
    "multiprocess",
    "fsspec",
    "filelock",
    "tqdm",
    "packaging",
    "deepspeed",
    "hjson",
    "peft",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "torchao",
)
WHEEL_DIR = ROOT / ".gpu" / "whl"
SITE = Path("/tmp/posttrain-site")
#: tests/gpu in the order they run, the most telling and quickest first (what the time limit stops is the
#: end: DeepSpeed's op builds and the memory plan's many runs); a test file not named here runs last
TEST_ORDER = (
    "test_document_attention_gpu.py",
    "test_fp8_gpu.py",
    "test_cuda_paths_gpu.py",
    "test_gpu_training.py::test_bf16_training_on_cuda",
    "test_grpo_gpu.py",
    "test_preference_gpu.py",
    "test_long_sequences_gpu.py",
    "test_observability_gpu.py",
    "test_gpu_training.py",
    "test_vision_gpu.py",
    "test_long_online_gpu.py",
    "test_memory_plan_gpu.py",
)
#: (name, what is compared, the least ratio); plan errors are checked separately (within 20%)
GOALS = (
    ("packed SFT >= 0.95x the bf16 bare loop", "posttrain/packed", "bare-bf16/packed", 0.95),
    ("with model.compile >= 1.05x the bare loop", "posttrain/compile", "bare-bf16/packed", 1.05),
    ("fp8 with compile >= 1.2x bf16 with compile", "posttrain/fp8-compile", "posttrain/compile", 1.2),
)
PLAN_TOLERANCE = 0.20
#: seconds each step may take on the GPU at most, and the whole command (the issue's 9 minutes, less the
#: report); the dry run's are generous (a busy 2-core CPU)
BUDGET = {"install": 90, "environment": 60, "throughput": 300, "tests": 400, "all": 525}
DRY_BUDGET = {"install": 60, "environment": 120, "throughput": 600, "tests": 300, "all": 1200}


@dataclass
class Step:
    name: str
    status: str = "skipped"  # ok | failed | skipped
    seconds: float = 0.0
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


def requirements() -> list[str]:
    """``name==version`` of every carried package, as installed here (what ``make gpu-wheels`` fetches)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in WHEELS:
        try:
            out.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} (not installed here)")
    return out


def child_env(dry_run: bool, carried: bool) -> dict[str, str]:
    """What every child process runs with: the carried packages first, the checkout's source, offline."""
    env = dict(os.environ)
    paths = [str(ROOT / "src"), str(ROOT)]
    if carried:
        paths.insert(0, str(SITE))
    if not dry_run:
        env.pop("DS_ACCELERATOR", None)  # DeepSpeed finds CUDA itself
        env.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/torch_extensions")
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error")
    return env


def run(command: list[str], env: dict[str, str], timeout: float, log: Path) -> tuple[int | None, str]:
    """Run ``command`` (its output to ``log``, the last 200 KB kept); ``None`` for the exit code when it ran
    past ``timeout`` and was killed with its process group."""
    with open(log, "w", encoding="utf-8") as out:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = process.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
            code = None
    text = log.read_text(encoding="utf-8", errors="replace")
    if len(text) > 200_000:
        log.write_text(text[-200_000:], encoding="utf-8")
    return code, text


# ------------------------------------------------------------------ the steps


def install(args: Any, step: Step) -> None:
    if not args.carried:
        missing = [line for line in requirements() if "not installed" in line]
        step.data["requirements"] = requirements()
        if missing:
            raise RuntimeError(f"not installed here, so make gpu-wheels cannot fetch them: {missing}")
        step.detail = (
            f"{len(WHEELS)} packages the GPU run carries are installed here (dry run: nothing copied)"
        )
        return
    wheels = sorted(WHEEL_DIR.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"no wheels in {WHEEL_DIR}: run make gpu-wheels here and carry .gpu")
    if any(w.name.startswith("torch-") for w in wheels):
        raise RuntimeError("a torch wheel is in .gpu/whl: the image's CUDA build must stay; remove it")
    marker = SITE / f".installed-{len(wheels)}-{sum(w.stat().st_size for w in wheels)}"
    if marker.exists():
        step.detail = f"{len(wheels)} wheels already installed in {SITE} (warm machine)"
        return
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    command += ["--upgrade", "--target", str(SITE), *map(str, wheels)]
    code, text = run(command, dict(os.environ), args.time_left("install"), args.out / "install.log")
    if code != 0:
        raise RuntimeError(f"pip install failed ({code}): {text[-1500:]}")
    marker.touch()
    step.detail = f"{len(wheels)} wheels into {SITE}: " + ", ".join(w.name.split("-")[0] for w in wheels)


ENVIRONMENT = """
import importlib.metadata as m, importlib.util, json, os, platform, torch
names = ["torch", "transformers", "tokenizers", "huggingface-hub", "safetensors", "accelerate", "peft",
         "datasets", "deepspeed", "pydantic", "torchao", "triton", "numpy", "pyarrow", "bitsandbytes",
         "liger-kernel", "flash-attn", "vllm", "trl", "pytest-timeout"]
versions = {}
for name in names:
    try:
        versions[name] = m.version(name)
    except m.PackageNotFoundError:
        versions[name] = None
cuda = torch.cuda.is_available()
facts = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
         "device": torch.cuda.get_device_name() if cuda else "cpu", "cpus": os.cpu_count(),
         "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
         "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
         "vllm": importlib.util.find_spec("vllm") is not None, "versions": versions}
import posttrain, transformers, deepspeed, torchao.float8  # what every run imports, from the carried wheels
facts["posttrain_from"] = posttrain.__file__
print(json.dumps(facts))
"""


def environment(args: Any, step: Step) -> None:
    code, text = run(
        [sys.executable, "-c", ENVIRONMENT],
        args.env,
        args.time_left("environment"),
        args.out / "environment.log",
    )
    if code != 0:
        raise RuntimeError(f"the environment does not import ({code}): {text[-1500:]}")
    facts = json.loads(text.strip().splitlines()[-1])
    step.data = facts
    if not args.dry_run and facts["device"] == "cpu":
        raise RuntimeError("torch sees no CUDA device on the lent machine")
    step.detail = (
        f"{facts['device']}, torch {facts['torch']} (CUDA {facts['cuda']}), Python {facts['python']}"
    )


def throughput(args: Any, step: Step) -> None:
    results = args.out / "throughput.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_throughput.py"), "--json", str(results)]
    command += ["--runners", "bare-bf16,posttrain", "--modes", args.modes]
    command += ["--work", str(args.work / "throughput")]
    if args.dry_run:  # the same modes on the tiny model; both compiled modes compile on the CPU
        command += ["--size", "tiny", "--steps", "4", "--peak-tflops", "1"]
    else:
        command += ["--size", "1b", "--seq-len", "8192", "--steps", "10", "--accumulation", "4"]
    code, text = run(command, args.env, args.time_left("throughput"), args.out / "throughput.log")
    data = json.loads(results.read_text()) if results.is_file() else {"results": {}, "failed": []}
    step.data = data
    done = sorted(data["results"])
    if code is None:
        raise RuntimeError(f"stopped at its time limit with {len(done)} runners done: {', '.join(done)}")
    if code != 0:
        raise RuntimeError(f"exit {code}; failed: {data.get('failed')}; {text[-1500:]}")
    step.detail = f"{len(done)} runners: {', '.join(done)}"


TEST_LINE = re.compile(r"^(tests/gpu/\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", re.M)


def tests(args: Any, step: Step) -> None:
    found = {p.name for p in (ROOT / "tests" / "gpu").glob("test_*.py")}
    ordered = [n for n in TEST_ORDER if n.split("::")[0] in found]
    ordered += sorted(found - {n.split("::")[0] for n in TEST_ORDER})
    done_file = args.work / "tests-done.json"  # what an earlier call on this machine ran (--resume)
    earlier = json.loads(done_file.read_text()) if args.resume and done_file.is_file() else {}
    command = [sys.executable, "-m", "pytest", "-v", "-rA", "-p", "no:cacheprovider", "-o", "addopts="]
    command += ["-m", "gpu", "--timeout", str(args.test_timeout)]
    command += [f"tests/gpu/{name}" for name in ordered] if not args.tests else args.tests.split(",")
    command += [f"--deselect={name}" for name in earlier]
    code, text = run(command, args.env, args.time_left("tests"), args.out / "tests.log")
    outcomes: dict[str, str] = {}
    for name, outcome in TEST_LINE.findall(text):
        outcomes[name] = outcome  # -rA repeats each line in its summary; the last word is the same
    done_file.write_text(json.dumps({**earlier, **outcomes}))
    step.data = {"outcomes": outcomes, "exit": code, "earlier": earlier}
    counts = {kind: sum(1 for o in outcomes.values() if o == kind) for kind in ("PASSED", "FAILED", "ERROR")}
    counts["SKIPPED"] = sum(1 for o in outcomes.values() if o == "SKIPPED")
    step.detail = ", ".join(f"{n} {k.lower()}" for k, n in counts.items() if n)
    if code is None:
        raise RuntimeError(f"stopped at its time limit after {len(outcomes)} tests ({step.detail})")
    if code not in (0, 5) or counts["FAILED"] or counts["ERROR"]:  # 5: none collected (none selected)
        failed = [n for n, o in outcomes.items() if o in ("FAILED", "ERROR")]
        raise RuntimeError(f"exit {code}; failed: {failed}")


def vllm(args: Any, step: Step, facts: dict[str, Any], outcomes: dict[str, str]) -> None:
    ran = {name: o for name, o in outcomes.items() if "vllm" in name or "server_mode" in name}
    if facts.get("vllm"):
        step.data = ran
        step.detail = f"vLLM {facts['versions'].get('vllm')}: " + ", ".join(
            f"{n}: {o}" for n, o in ran.items()
        )
        if any(o not in ("PASSED",) for o in ran.values()):
            raise RuntimeError(step.detail)
        return
    step.status = "skipped"
    step.detail = (
        "vLLM is not installed on this machine, and its wheel (hundreds of MB with its CUDA kernels) is far "
        "over the 64 MiB that travels to the lent machine: GRPO ran with transformers' generate "
        "(tests/gpu/test_grpo_gpu.py); use_vllm on a GPU stays unmeasured"
    )


# ------------------------------------------------------------------ the report


def judge(steps: dict[str, Step], dry_run: bool) -> list[dict[str, Any]]:
    """Each goal: the measured ratio or plan error and whether it holds (not judged on a CPU)."""
    rows = steps["throughput"].data.get("results", {})
    goals: list[dict[str, Any]] = []
    for name, mine, baseline, least in GOALS:
        ratio = None
        if mine in rows and baseline in rows and rows[baseline]["tokens_per_second"]:
            ratio = rows[mine]["tokens_per_second"] / rows[baseline]["tokens_per_second"]
        held = None if dry_run or ratio is None else ratio >= least
        goals.append({"goal": name, "value": ratio, "held": held})
    for mode, result in rows.items():
        if "plan_error" in result:
            error = result["plan_error"]
            held = None if dry_run else abs(error) <= PLAN_TOLERANCE
            goals.append(
                {"goal": f"memory plan of {mode} within 20% of its peak", "value": error, "held": held}
            )
    return goals


def table(steps: dict[str, Step], goals: list[dict[str, Any]], dry_run: bool) -> str:
    facts = steps["environment"].data
    title = "GPU check (dry run on the CPU: sizes tiny, no goal judged)" if dry_run else "GPU check"
    out = [
        f"# {title}",
        "",
        f"{time.strftime('%Y-%m-%d')}, {facts.get('device', '?')}, torch {facts.get('torch')}",
    ]
    out += ["", "| step | status | seconds | detail |", "|---|---|---|---|"]
    for step in steps.values():
        detail = step.detail.replace("|", "/").replace("\n", " ")[:400]
        out.append(f"| {step.name} | {step.status} | {step.seconds:.0f} | {detail} |")
    rows = steps["throughput"].data.get("results", {})
    if rows:
        base = rows.get("bare-bf16/packed", {}).get("tokens_per_second")
        out += ["", "| runner/mode | tokens/s | x bare bf16 | MFU | peak GiB | plan GiB | plan error |"]
        out.append("|---|---|---|---|---|---|---|")
        for name, r in rows.items():
            ratio = f"{r['tokens_per_second'] / base:.2f}" if base else "-"
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
            plan = f"{r['plan_gib']:.2f}" if "plan_gib" in r else "-"
            error = f"{r['plan_error']:+.0%}" if "plan_error" in r else "-"
            out.append(
                f"| {name} | {r['tokens_per_second']:,.0f} | {ratio} | {mfu} | {r['peak_memory_gib']:.2f} | "
                f"{plan} | {error} |"
            )
    out += ["", "| goal | measured | held |", "|---|---|---|"]
    for goal in goals:
        value = goal["value"]
        shown = "-" if value is None else (f"{value:+.0%}" if "plan" in goal["goal"] else f"{value:.2f}x")
        held = {True: "yes", False: "NO", None: "not judged"}[goal["held"]]
        out.append(f"| {goal['goal']} | {shown} | {held} |")
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the same steps at tiny sizes on this CPU")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "gpu-check-out"))
    parser.add_argument("--work", type=Path, default=None, help="models and data (default /tmp/gpu-check)")
    parser.add_argument("--test-timeout", type=int, default=150, help="seconds per GPU test")
    parser.add_argument("--requirements", action="store_true", help="print what make gpu-wheels fetches")
    parser.add_argument("--steps", default="install,environment,throughput,tests", help="the steps to run")
    parser.add_argument("--modes", default="packed,compile,fp8-compile", help="throughput: posttrain's modes")
    parser.add_argument("--tests", default="", help="tests: these node ids only (comma-separated)")
    parser.add_argument(
        "--resume", action="store_true", help="tests: leave out those an earlier call on this machine ran"
    )
    parser.add_argument(
        "--budget", dest="budget_seconds", type=float, default=None, help="seconds for the whole command"
    )
    parser.add_argument(
        "--with-wheels",
        action="store_true",
        help="dry run: install the carried wheels and run on them, as the GPU run does (another Python here)",
    )
    args = parser.parse_args()
    if args.requirements:
        print("\n".join(requirements()))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = args.work or (args.out / "work" if args.dry_run else Path("/tmp/gpu-check"))
    args.work.mkdir(parents=True, exist_ok=True)
    args.budget = dict(DRY_BUDGET if args.dry_run else BUDGET)
    deadline = time.monotonic() + (args.budget_seconds or args.budget["all"])
    args.time_left = lambda name: min(args.budget[name], deadline - time.monotonic())
    args.carried = not args.dry_run or args.with_wheels
    args.env = child_env(args.dry_run, args.carried)
    steps = {name: Step(name) for name in ("install", "environment", "throughput", "tests", "vllm")}
    actions = {"install": install, "environment": environment, "throughput": throughput, "tests": tests}
    chosen = {name.strip() for name in args.steps.split(",")}
    for name, action in actions.items():
        if name not in chosen:
            continue
        step, started = steps[name], time.perf_counter()
        print(f"[gpu-check] {name} ...", flush=True)
        try:
            action(args, step)
            step.status = "ok"
        except Exception as error:  # every step is recorded, whatever it raised
            step.status, step.detail = "failed", f"{type(error).__name__}: {error}"[:3000]
        step.seconds = time.perf_counter() - started
        print(f"[gpu-check] {name}: {step.status} ({step.seconds:.0f} s) {step.detail[:300]}", flush=True)
        if name == "install" and step.status == "failed":
            break  # nothing else can import
    try:
        vllm(args, steps["vllm"], steps["environment"].data, steps["tests"].data.get("outcomes", {}))
        steps["vllm"].status = steps["vllm"].status if steps["vllm"].status == "skipped" else "ok"
    except Exception as error:
        steps["vllm"].status, steps["vllm"].detail = "failed", str(error)
    goals = judge(steps, args.dry_run)
    report = {"dry_run": args.dry_run, "steps": {n: asdict(s) for n, s in steps.items()}, "goals": goals}
    (args.out / "results.json").write_text(json.dumps(report, indent=2, default=str))
    text = table(steps, goals, args.dry_run)
    (args.out / "table.md").write_text(text)
    print(text)
    # the workspace's own files stay out of $OUT (only results, table and logs travel back)
    return 1 if any(s.status == "failed" for s in steps.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
