#!/usr/bin/env python
"""Chaos soak: train a multi-rank GPT while injecting faults at random moments (from --seed), relaunch it as
a cluster scheduler would until --train-iters is reached, then train the same iterations uninterrupted and
compare: the loss curve (each iteration's last logged value) and the final checkpoint's tensors, bit for
bit; and every checkpoint that was ever complete must still be there or set aside with a notice.

    python tools/soak.py --seed 1 --faults 7 --json soak.json [-- pretrain_gpt.py flags]

Fault kinds (--kinds): sigkill (one rank, mid-step), kill-save (one rank while a save is written: with
--async-save, during the background write), sigterm (every rank, as before preemption: the job saves and
exits 0), hang (SIGSTOP of one rank past --distributed-timeout-minutes: the others' collective times out,
the job ends, the soak SIGKILLs the stopped rank and relaunches), disk-full (RLIMIT_FSIZE on one running
rank until a save has failed: training goes on), corrupt (the job stopped, 16 bytes flipped in a tensor
file of the newest checkpoint), tracker (the job stopped, the tracker deleted or garbled). Without flags
after ``--`` the job is a tiny GPT at DP2 with the distributed optimizer and --async-save on CPU.
docs/training.md, "Fault tolerance", has the figures. Exit status 0 when the soak passed, 1 when not.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import resource
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config.domain import Domain, count, domain_option, positive
from tools.soak_parts.checks import (
    compare_final,
    complete,
    corrupt_newest,
    damage_tracker,
    missing_checkpoints,
    passing,
    tracked,
)
from tools.soak_parts.job import ERROR, LOADED, LOSS, SAVE_FAILED, SAVED, SAVING, Job, Line

KINDS = ("sigkill", "kill-save", "sigterm", "hang", "disk-full", "corrupt", "tracker")
ENDING = ("sigkill", "kill-save", "sigterm", "hang")  # in-run faults that end the launch
BETWEEN = ("corrupt", "tracker")  # done to the folder after a launch ended (alone: every rank SIGKILLed first)
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--mock-data", "--vocab-size", "128",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0",
         "--use-distributed-optimizer", "--async-save"]
FSIZE_LIMIT = 1024  # bytes: below every tensor file a rank writes (its RNG state alone is ~5 KB)
STALL_S = 120.0  # no log line for this long: the soak itself gives up (a hang nothing ended)


class SoakFailed(RuntimeError):
    """The run needed a human: a launch failed without a fault, a hang was not ended, the job stalled."""


@dataclass
class Fault:
    kind: str
    at: int  # planned: injected once the job has logged this iteration
    launch: int = 0
    iteration: int = 0  # the last iteration logged when it was injected
    detail: str = ""
    resumed_from: int | None = None  # the iteration the next launch loaded
    recomputed: int = 0  # iterations logged before the fault and trained again after it
    lost_s: float | None = None  # from the fault until training passed ``iteration`` again
    t: float = 0.0
    tracked: int | None = None  # corrupt, tracker: the iteration the tracker named before the damage


class Soak:
    def __init__(self, opts: argparse.Namespace, model: list[str]) -> None:
        self.o, self.rng = opts, random.Random(opts.seed)
        os.makedirs(opts.workdir, exist_ok=True)
        self.ck, self.log = os.path.join(opts.workdir, "ck"), os.path.join(opts.workdir, "soak.log")
        minutes = opts.timeout_minutes if opts.hang_detection == "on" else 30.0
        self.common = [*model, "--train-iters", str(opts.train_iters), "--log-interval", "1",
                       "--exit-signal-handler", "--distributed-timeout-minutes", f"{minutes:g}"]
        self.async_save = "--async-save" in model
        self.losses: dict[int, str] = {}
        self.iteration, self.steps = 0, 0  # last iteration logged in this launch, iterations logged in it
        self.saving: list[int] = []
        self.saved: list[int] = []
        self.save_failed: list[int] = []
        self.notices: list[str] = []
        self.errors: list[str] = []
        self.ever: set[int] = set()
        self.open: list[Fault] = []  # faults whose lost time is still running
        self.resuming: list[Fault] = []  # the fault that ended the last launch, and the damage done after it
        self.faults: list[Fault] = []
        self._ready_cache: tuple[int, bool] = (-1, False)

    # ---- reading the log ---------------------------------------------------------------------------
    def observe(self, line: Line) -> None:
        text = line.text
        if (m := LOSS.search(text)) is not None:
            it = int(m[1])
            self.losses[it] = m[2]
            if self.resuming and self.steps == 0:  # the launch started afresh, loading nothing
                self._resumed(it - 1)
            self.iteration, self.steps = it, self.steps + 1
            for f in [f for f in self.open if it > f.iteration]:
                f.lost_s = round(line.t - f.t, 2)
                self.open.remove(f)
        elif (m := LOADED.search(text)) is not None and self.resuming:
            self._resumed(int(m[1]))
        elif (m := SAVING.search(text)) is not None:
            self.saving.append(int(m[1]))
        elif (m := SAVE_FAILED.search(text)) is not None:
            self.save_failed.append(int(m[1]))
            self.notices.append(text.strip())
        elif (m := SAVED.search(text)) is not None:
            self.saved.append(int(m[1]))
        if "set aside as" in text or "scanning the iteration folders" in text or "resuming from iter_" in text:
            self.notices.append(text.strip())
        if ERROR in text:
            self.errors.append(text.strip())

    def _resumed(self, loaded: int) -> None:
        """The relaunch after ``self.resuming[0]`` (and the damage done after it) loaded ``loaded``: the ending
        fault recomputes down to the checkpoint the tracker named when it ended, the damage the rest."""
        first, damage = self.resuming[0], self.resuming[1:]
        named = damage[0].tracked if damage and damage[0].tracked is not None else loaded
        for f in self.resuming:
            f.resumed_from = loaded
        first.recomputed = max(0, first.iteration - max(named, loaded))
        for f in damage:  # two kinds of damage after one ending share its cost
            f.recomputed = max(0, min(named, first.iteration) - loaded)
        self.resuming = []

    def pump(self, job: Job, until: Callable[[], bool], timeout: float, stopped: int | None = None,
             poll: float = 0.05) -> bool:
        """Read lines until ``until()`` (True), the job ended and its output is read, or ``timeout`` (False)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if until():
                return True
            line = job.next_line(poll)
            if line is not None:
                self.observe(line)
                continue
            job.reap(self.o.grace_s, stopped)
            if not job.running() and job.lines.empty():
                return until()
        return until()

    # ---- the plan ------------------------------------------------------------------------------------
    def plan(self) -> list[Fault]:
        kinds = list(self.o.kinds)
        self.rng.shuffle(kinds)
        while len(kinds) < self.o.faults:
            kinds.append(self.rng.choice(self.o.kinds))
        kinds = kinds[:self.o.faults]
        lo, hi = 2 * self.o.save_interval + 1, self.o.train_iters - self.o.save_interval - 2
        if hi - lo < len(kinds):
            raise SystemExit(f"soak.py: error: --train-iters {self.o.train_iters} leaves too few iterations for "
                             f"{len(kinds)} faults at --save-interval {self.o.save_interval}")
        ats = sorted(self.rng.sample(range(lo, hi), len(kinds)))
        ending = [i for i, k in enumerate(kinds) if k in ENDING]
        if ending and kinds[-1] in BETWEEN:  # damage is done after a launch ended: one must end after it
            kinds[-1], kinds[ending[-1]] = kinds[ending[-1]], kinds[-1]
        return [Fault(k, a) for k, a in zip(kinds, ats, strict=True)]

    def ready(self, f: Fault) -> bool:
        """Whether ``f`` can be injected now (its iteration reached, this launch trained, the state it needs)."""
        if self.iteration < f.at or self.steps < 1:
            return False
        if f.kind in ("kill-save", "disk-full"):  # the save it hits must not be the run's final one
            return self.iteration + 2 * self.o.save_interval < self.o.train_iters
        if f.kind == "corrupt":  # a previous checkpoint must pass, for the run to fall back to
            if self._ready_cache[0] != len(self.saved):
                self._ready_cache = (len(self.saved), len(passing(self.ck)) >= 2)
            return self._ready_cache[1]
        return True

    # ---- injecting -----------------------------------------------------------------------------------
    def inject(self, f: Fault, job: Job, launch: int) -> bool:
        """Inject ``f``; returns whether it ends the launch."""
        f.launch, f.iteration, f.t = launch, self.iteration, time.monotonic()
        rank = self.rng.randrange(job.nproc)
        if f.kind == "sigkill":
            time.sleep(self.rng.uniform(0.0, 0.05))
            job.signal(rank, signal.SIGKILL)
            f.detail = f"rank {rank} SIGKILLed mid-step"
        elif f.kind == "kill-save":
            f.detail = self._kill_in_save(job, rank)
        elif f.kind == "sigterm":
            for r in range(job.nproc):
                job.signal(r, signal.SIGTERM)
            f.detail = "SIGTERM to every rank"
        elif f.kind == "hang":
            return self._hang(job, f)
        elif f.kind == "disk-full":
            f.detail = self._disk_full(job, rank)
            f.lost_s, f.resumed_from = 0.0, None
            return False
        else:  # corrupt, tracker: the job is stopped (a node lost), the folder damaged before the relaunch
            for r in range(job.nproc):
                job.signal(r, signal.SIGKILL)
            f.detail = "every rank SIGKILLed; then "
        self.pump(job, lambda: not job.running(), 60.0)
        self._ended(f)
        return True

    def _ended(self, f: Fault) -> None:
        """The launch ``f`` ended is over: what it had logged is what a restart may recompute."""
        f.iteration = max(f.iteration, self.iteration)
        self.open.append(f)

    def _kill_in_save(self, job: Job, rank: int) -> str:
        if self.async_save:
            seen = len(self.saving)
            self.pump(job, lambda: len(self.saving) > seen, STALL_S, poll=0.002)
            it = self.saving[-1] if len(self.saving) > seen else None
            job.signal(rank, signal.SIGKILL)
            when = "after its commit" if it in self.saved else "before its commit"
            return f"rank {rank} SIGKILLed during the background save of iteration {it} ({when})"
        staged = os.path.join(self.ck, ".iter_*.incomplete.*")
        self.pump(job, lambda: bool(glob.glob(staged)), STALL_S, poll=0.002)
        found = glob.glob(staged)
        job.signal(rank, signal.SIGKILL)
        return f"rank {rank} SIGKILLed " + (f"while {os.path.basename(found[0])} was written" if found else
                                             "(no save was seen in progress)")

    def _hang(self, job: Job, f: Fault) -> bool:
        rank = self.rng.randrange(1, job.nproc)  # rank 0 hosts the store: its peers would see it as lost
        job.signal(rank, signal.SIGSTOP)
        ended = self.pump(job, lambda: any(c is not None for c in job.codes()), self.o.hang_limit_s, stopped=rank)
        if not ended:
            job.close()
            raise SoakFailed(f"rank {rank} was stopped (SIGSTOP) at iteration {f.iteration} and no rank ended within "
                             f"{self.o.hang_limit_s:g} s: the hang was not detected (a human would have to end it)")
        took = time.monotonic() - f.t
        self.pump(job, lambda: not job.running(), 60.0, stopped=rank)
        self._ended(f)
        named = any(f"rank {rank} (pid" in e and "stopped" in e for e in self.errors[-3:])
        f.detail = (f"rank {rank} SIGSTOPped; the job ended after {took:.1f} s, "
                    + ("the failure board named it" if named else "the failure board did NOT name it"))
        return True

    def _disk_full(self, job: Job, rank: int) -> str:
        pid = job.procs[rank].pid
        before = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        failed, saved = len(self.save_failed), len(self.saved)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (FSIZE_LIMIT, before[1]))
        try:
            self.pump(job, lambda: len(self.save_failed) > failed or len(self.saved) > saved + 1, STALL_S)
        finally:
            if job.procs[rank].poll() is None:
                resource.prlimit(pid, resource.RLIMIT_FSIZE, before)
        if len(self.save_failed) > failed:
            return f"rank {rank} limited to {FSIZE_LIMIT} B files: the save of iteration {self.save_failed[-1]} failed"
        return f"rank {rank} limited to {FSIZE_LIMIT} B files, but no save failed (missed)"

    # ---- the run -------------------------------------------------------------------------------------
    def launch(self, n: int, plan: list[Fault]) -> tuple[Job, Fault | None]:
        """One launch, with the plan's faults injected while it runs; returns it (ended) and the fault that
        ended it, if any."""
        job = Job([*self.common, "--save", self.ck, "--load", self.ck, "--save-interval", str(self.o.save_interval)],
                  self.o.nproc, self.log).start()
        self.iteration, self.steps = 0, 0
        try:
            while (f := self._next_in_run(plan)) is not None:
                if not self.pump(job, lambda f=f: self.ready(f), STALL_S):
                    if not job.running():
                        return job, None
                    raise SoakFailed(f"launch {n}: no progress for {STALL_S:g} s (last iteration {self.iteration})")
                plan.remove(f)
                self.faults.append(f)
                if self.inject(f, job, n):
                    return job, f
            if not self.pump(job, lambda: not job.running(), STALL_S * 5):
                raise SoakFailed(f"launch {n}: did not end")
            return job, None
        finally:
            job.close()
            while (line := job.next_line(0.01)) is not None:
                self.observe(line)
            self.ever |= complete(self.ck)

    @staticmethod
    def _next_in_run(plan: list[Fault]) -> Fault | None:
        """The next fault to inject into the running job: an in-run one, or a between-run one when no
        in-run fault is left to end a launch for it (it then stops every rank itself)."""
        return next((f for f in plan if f.kind not in BETWEEN), plan[0] if plan else None)

    def after(self, ended: Fault, plan: list[Fault], launch: int) -> None:
        """The launch ``ended`` ended: do the due between-run faults to the folder (a shard's bytes flipped,
        the tracker deleted or garbled); the next launch's load answers them."""
        damage = [ended] if ended.kind in BETWEEN else []
        for f in [f for f in plan if f.kind in BETWEEN and f.at <= self.iteration]:
            if f.kind == "corrupt" and len(passing(self.ck)) < 2:
                continue  # no previous checkpoint to fall back to yet: at a later ending
            plan.remove(f)
            self.faults.append(f)
            f.launch, f.iteration, f.t, f.detail, f.lost_s = launch, self.iteration, time.monotonic(), "", None
            damage.append(f)
        self.resuming = [ended]
        for f in damage:
            rng = random.Random(self.rng.random())
            f.tracked = tracked(self.ck)
            if f.kind == "corrupt":
                f.detail += f"{corrupt_newest(self.ck, rng)} had 16 bytes flipped"
            else:
                f.detail += f"the tracker was {damage_tracker(self.ck, rng)}"
            if f is not ended:
                self.resuming.append(f)

    def run(self) -> dict:
        t0 = time.monotonic()
        plan = self.plan()
        launches, failure = 0, None
        try:
            while True:
                launches += 1
                if launches > self.o.faults + 4:
                    raise SoakFailed(f"{launches - 1} launches did not reach iteration {self.o.train_iters}")
                job, f = self.launch(launches, plan)
                codes = job.codes()
                if f is not None:
                    if f.kind == "sigterm" and any(codes):
                        raise SoakFailed(f"launch {launches}: SIGTERM with --exit-signal-handler ended with "
                                         f"status {codes}, not 0: {self.errors[-1:]}")
                    self.after(f, plan, launches)
                    continue
                if any(codes) or self.iteration < self.o.train_iters:
                    raise SoakFailed(f"launch {launches} ended with status {codes} at iteration {self.iteration} "
                                     f"without a fault: {self.errors[-1] if self.errors else 'no error line'}")
                break
        except SoakFailed as e:
            failure = str(e)
        soak_s = time.monotonic() - t0
        return self.report(launches, soak_s, failure)

    def reference(self) -> tuple[dict[int, str], str, float]:
        """The same iterations uninterrupted: its losses, its checkpoint folder and wall time."""
        ref = os.path.join(self.o.workdir, "reference")
        t0 = time.monotonic()
        job = Job([*self.common, "--save", ref, "--save-interval", str(self.o.train_iters)], self.o.nproc,
                  os.path.join(self.o.workdir, "reference.log")).start()
        losses: dict[int, str] = {}
        try:
            while job.running() or not job.lines.empty():
                line = job.next_line(0.1)
                if line is not None and (m := LOSS.search(line.text)):
                    losses[int(m[1])] = m[2]
                elif line is None and time.monotonic() - t0 > STALL_S * 5:
                    raise SoakFailed("the uninterrupted run did not end")
        finally:
            job.close()
        if any(job.codes()):
            raise SoakFailed(f"the uninterrupted run failed with status {job.codes()}; see reference.log")
        return losses, ref, time.monotonic() - t0

    def report(self, launches: int, soak_s: float, failure: str | None) -> dict:
        out: dict = {"seed": self.o.seed, "train_iters": self.o.train_iters, "nproc": self.o.nproc,
                     "flags": self.common, "launches": launches, "restarts": launches - 1,
                     "faults": [{k: v for k, v in asdict(f).items() if k != "t"} for f in self.faults],
                     "faults_by_kind": dict(Counter(f.kind for f in self.faults)), "soak_s": round(soak_s, 1),
                     "recomputed": sum(f.recomputed for f in self.faults),
                     "lost_s": round(sum(f.lost_s or 0.0 for f in self.faults), 1), "notices": self.notices,
                     "failure": failure, "losses_equal": False, "weights_equal": False,
                     "ever_complete": sorted(self.ever), "missing_checkpoints": []}
        if failure is None:
            try:
                ref_losses, ref, out["reference_s"] = self.reference()
                out["reference_s"] = round(out["reference_s"], 1)
                diff = [i for i in range(1, self.o.train_iters + 1) if self.losses.get(i) != ref_losses.get(i)]
                out["losses_equal"] = not diff
                pairs = [(self.losses.get(i), ref_losses.get(i)) for i in diff[:3]]
                out["loss_note"] = (f"{self.o.train_iters} of {self.o.train_iters} iterations equal" if not diff else
                                    f"iterations {diff[:5]} differ: {pairs}")
                out["weights_equal"], out["weights_note"] = compare_final(self.ck, ref, self.o.train_iters)
                out["missing_checkpoints"] = missing_checkpoints(self.ck, self.ever, self.notices)
            except SoakFailed as e:
                out["failure"] = str(e)
        out["passed"] = (out["failure"] is None and out["losses_equal"] and out["weights_equal"]
                         and not out["missing_checkpoints"])
        return out


def print_report(r: dict) -> None:
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(r["faults_by_kind"].items()))
    print(f"soak: seed {r['seed']}, {r['nproc']} ranks, {r['train_iters']} iterations; {len(r['faults'])} faults "
          f"({kinds}); {r['restarts']} restarts")
    print(f" {'#':>2}  {'kind':9} {'iter':>4} {'launch':>6} {'recomputed':>10} {'lost s':>7}  what happened")
    for i, f in enumerate(r["faults"], 1):
        lost = "-" if f["lost_s"] is None else f"{f['lost_s']:.1f}"
        print(f" {i:>2}  {f['kind']:9} {f['iteration']:>4} {f['launch']:>6} {f['recomputed']:>10} {lost:>7}  "
              f"{f['detail']}")
    print(f"iterations recomputed: {r['recomputed']}; wall time lost to faults: {r['lost_s']:.1f} s of "
          f"{r['soak_s']:.1f} s (uninterrupted run: {r.get('reference_s', '-')} s)")
    for n in r["notices"]:
        print(f"notice: {n}")
    if r["failure"] is None:
        print(f"loss curve: {r['loss_note']}")
        print(f"final weights: {r['weights_note']}")
        print(f"checkpoints ever complete: {len(r['ever_complete'])}; lost: {r['missing_checkpoints'] or 'none'}")
    print("PASSED" if r["passed"] else f"FAILED: {r['failure'] or 'the end state differs (above)'}")


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:] if argv is None else argv
    model = MODEL
    if "--" in argv:
        cut = argv.index("--")
        argv, model = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="soak.py", description=__doc__.split("\n\n")[0])
    domain_option(p, "--seed", integer=True, default=1, domain=Domain(lo=0, hi=2**32 - 1),
                  help="Chooses the faults' kinds, iterations, ranks and bytes.")
    domain_option(p, "--faults", integer=True, default=7, domain=Domain(lo=0, hi=10_000), help="Faults to inject.")
    p.add_argument("--kinds", type=lambda s: s.split(","), default=list(KINDS),
                   help=f"Comma-separated fault kinds (default all: {','.join(KINDS)}).")
    domain_option(p, "--train-iters", integer=True, default=60, domain=count())
    domain_option(p, "--save-interval", integer=True, default=5, domain=count())
    domain_option(p, "--nproc", integer=True, default=2, domain=Domain(lo=2, hi=64), help="Ranks of the job.")
    domain_option(p, "--timeout-minutes", integer=False, default=0.15, domain=positive(24 * 60),
                  help="--distributed-timeout-minutes of the job: how long a hang lasts before the job ends.")
    p.add_argument("--hang-detection", choices=["on", "off"], default="on",
                   help="off: the job's collective timeout is 30 min, so a hang is not ended in time (the soak "
                   "then fails: shows what the timeout is for).")
    domain_option(p, "--hang-limit-s", integer=False, default=60.0, domain=positive(24 * 3600),
                  help="The longest the soak waits for a hang to end the job before it fails.")
    domain_option(p, "--grace-s", integer=False, default=10.0, domain=positive(3600),
                  help="After one rank ended, the others' time to end before SIGKILL (as a scheduler's).")
    p.add_argument("--workdir", default=None, help="Where the checkpoints and logs go (default: a new temp dir).")
    p.add_argument("--json", default=None, help="Also write the report here as JSON.")
    o = p.parse_args(argv)
    bad = [k for k in o.kinds if k not in KINDS]
    if bad:
        p.error(f"--kinds: unknown {bad}; choose from {', '.join(KINDS)}")
    o.workdir = o.workdir or tempfile.mkdtemp(prefix="soak-")
    return o, model


def main(argv: list[str] | None = None) -> int:
    opts, model = parse(argv)
    report = Soak(opts, model).run()
    report["workdir"] = opts.workdir
    print_report(report)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
