"""The learner's main loop: buffer → train step → checkpoint → ack → publish.

Exactly-once data (with `sinkflex.buffer.TrajectoryBuffer`'s at-least-once delivery):
- rank 0 reads groups as a member of the consumer group and broadcasts them, with any
  control command (checkpoint now, stop), to every rank once per tick;
- a group is acknowledged only after the checkpoint that records its id as trained has
  been written (`checkpoint.save_checkpoint` returns only once it is durable). A crash
  before that checkpoint loses the step and the group is redelivered and trained with
  the restored weights; a crash after it (before the ack) gets the group redelivered, and
  it is dropped because its id is in the checkpoint (`buffer.mark_trained` at start,
  plus the learner's own trained-id set);
- on resume, the policy version of the checkpoint is published again if its folder is
  missing (a crash between checkpoint and publish).

A policy version is published (<run_dir>/policy/v<N>, then UpdateWeights) only after the
checkpoint that holds it is durable, so `PolicyVersion` never names a version a crash could
take back; the driver treats a version as done once PolicyVersion names it and the rollout
engine serves it.

Bounded staleness (`max_staleness` k, not None): a group read from the buffer whose oldest
turn was sampled by a policy version older than (current version − k) is dropped: acknowledged
untrained (it is neither lost — the stream records it consumed — nor ever trained) and
counted (`LearnerState.groups_dropped_stale`, metrics dropped_stale_groups per step and
dropped_stale_groups_total). The version only changes when a step is trained, so the check
at read time is the check at training time.

Poison groups: each group is checked when rank 0 reads it (`batch.validate_group`: token ids
inside the vocabulary, lengths and masks consistent, finite log-probs and rewards; then
`Group.from_proto`); one that fails goes to the buffer's dead-letter stream with the error as
its reason, acknowledged and never trained, counted (`LearnerRunner.dead_lettered`, metric
dead_lettered_groups_total), and training goes on. A step's quota (`batch.groups_per_step`)
counts its dead-lettered groups as it counts the ones it trains: once the buffer has nothing
more to deliver and the groups read plus the groups dead-lettered reach the quota, the step
trains on the groups it has (metric dead_lettered_groups), so a synchronous run, whose
driver publishes exactly one step's groups, does not wait for groups that will never come.
While a step waits for its groups, the entries it holds are touched (`TrajectoryBuffer.touch`)
every `buffer.claim_idle_ms` / 3, so a slow producer never makes them idle long enough to be
reclaimed and delivered again. Trajectories are cut to `batch.max_seq_len`,
by default the model's `max_position_embeddings`. A step that raises anyway (world size 1)
rolls the learner back to its latest checkpoint and takes its unacknowledged entries back
(`TrajectoryBuffer.take_back`; each delivery counts); an entry delivered more than
`buffer.max_deliveries` times is dead-lettered by the buffer's `read`, so a group that makes the
step raise N times stops being retried and the rest train. With several ranks the exception
ends the process; the restarted learner resumes from its checkpoint and the same delivery
count applies.

Idle time: each step's metrics hold learner_idle_s (waiting for groups before it) and, from
the second step on, learner_idle_fraction: the share of the learner's wall time since the
first step started spent waiting for groups (the rest: training, checkpoints, publishing).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future

import torch.distributed as dist

from learner_service.batch import Group, validate_group
from learner_service.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from learner_service.publish import policy_dir, publish_policy
from learner_service.trainer import Learner

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Tick:
    """What rank 0 tells every rank to do this tick."""

    groups: tuple[Group, ...] = ()  # groups to train on (empty: none), decoded once on rank 0; pickled once by the broadcast
    checkpoint: bool = False
    stop: bool = False


class LearnerRunner:
    """Drives a `Learner` from a `TrajectoryBuffer`; thread-safe requests from the gRPC server.

    Args:
        learner: the learner (already restored from its checkpoint, if any).
        buffer: a `sinkflex.buffer.TrajectoryBuffer` (rank 0 only; None on other ranks).
    """

    def __init__(self, learner: Learner, buffer=None, on_step=None):
        self.learner = learner
        self.on_step = on_step  # rank 0: called with each step's metrics (e.g. Prometheus)
        self.buffer = buffer
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ckpt_waiters: list[Future] = []
        self.last_checkpoint: str = ""
        self.invalid_groups = 0  # groups that failed validation (rank 0), dead-lettered
        self.dead_lettered = 0  # groups this runner moved to the dead-letter stream (rank 0)
        self.step_failures = 0  # steps that raised and were rolled back to the checkpoint
        model_cfg = getattr(learner.model, "config", None)
        self.max_seq_len = learner.cfg.batch.max_seq_len or getattr(model_cfg, "max_position_embeddings", None)
        self.vocab_size = _vocab_size(learner.model)
        self._dropped_since_step = 0  # stale groups dropped since the last step (rank 0)
        self._dead_since_step = 0  # groups dead-lettered since the last step: part of its quota (rank 0)
        self._touched_at = time.monotonic()  # when the entries in `collected` were last touched (rank 0)

    # ------------------------------------------------------------------ requests (any thread)
    def request_stop(self) -> None:
        self._stop.set()

    def request_checkpoint(self) -> Future:
        """A future resolved with (path, policy_version, step) after the next checkpoint."""
        fut: Future = Future()
        with self._lock:
            self._ckpt_waiters.append(fut)
        return fut

    # ------------------------------------------------------------------ the loop
    def _next_tick(self, collected: list) -> Tick:
        """Rank 0: read from the buffer, decide this tick's command."""
        cfg = self.learner.cfg
        if self._stop.is_set():  # groups dropped since the last step are counted in a last checkpoint
            return Tick(stop=True, checkpoint=self._dropped_since_step > 0)
        quota = cfg.batch.groups_per_step
        want = quota - len(collected)
        delivered = 0
        if want > 0:
            held = {e.entry_id for e, _ in collected}
            dead_before = self.buffer.read_dead_letters
            entries = self.buffer.read(cfg.buffer.consumer, count=want, block_ms=cfg.buffer.block_ms)
            delivered = len(entries)
            self._dead_since_step += self.buffer.read_dead_letters - dead_before
            for entry in entries:
                if entry.entry_id in held:  # already held for this step (delivered again): train it once
                    continue
                try:  # the one conversion of this group (batch.Group): validated, advantages computed
                    validate_group(entry.group, self.vocab_size)
                    group = Group.from_proto(entry.group, cfg.grpo.adv_eps, self.max_seq_len, cfg.grpo.reward_shaping)
                except ValueError as err:
                    self.invalid_groups += 1
                    self.dead_lettered += 1
                    self._dead_since_step += 1
                    log.error("dead-lettering invalid group %s (entry %s): %s", entry.group.group_id, entry.entry_id, err)
                    self.buffer.dead_letter(cfg.buffer.consumer, [entry], f"learner validation: {err}")
                    continue
                if self._too_stale(entry, group):
                    continue
                collected.append((entry, group))
        with self._lock:
            ckpt = bool(self._ckpt_waiters)
        if len(collected) >= quota:
            return Tick(groups=tuple(g for _, g in collected), checkpoint=ckpt)
        if not delivered and len(collected) + self._dead_since_step >= quota:
            if collected:  # the buffer has nothing more: the step's other groups were dead-lettered
                log.warning("training step %d on %d groups: %d of its %d were dead-lettered",
                            self.learner.state.step + 1, len(collected), self._dead_since_step, quota)
                return Tick(groups=tuple(g for _, g in collected), checkpoint=ckpt)
            log.warning("all %d groups read for step %d were dead-lettered; waiting for more",
                        self._dead_since_step, self.learner.state.step + 1)
            self._dead_since_step = 0
        self._keep_claimed(collected)
        return Tick(checkpoint=ckpt)

    def _keep_claimed(self, collected: list) -> None:
        """Rank 0, while a step waits for its groups: touches the entries it holds every
        claim_idle_ms / 3 (so the buffer never reclaims them as idle and delivers them again),
        and drops any another consumer has reclaimed meanwhile (it trains them, not us)."""
        now = time.monotonic()
        if not collected:
            self._touched_at = now
            return
        if (now - self._touched_at) * 1000 < self.buffer.claim_idle_ms / 3:
            return
        self._touched_at = now
        owned = self.buffer.touch(self.learner.cfg.buffer.consumer, [e for e, _ in collected])
        lost = [e.group.group_id for (e, _), mine in zip(collected, owned) if not mine]
        if lost:
            log.warning("groups %s were reclaimed by another consumer while this step waited: not trained here", lost)
            collected[:] = [c for c, mine in zip(collected, owned) if mine]

    def _too_stale(self, entry, group: Group) -> bool:
        """Rank 0: drops (acknowledges untrained, counts) a group older than max_staleness allows."""
        k = self.learner.cfg.max_staleness
        if k is None:
            return False
        version = self.learner.state.policy_version
        oldest = group.policy_version
        if version - oldest <= k:
            return False
        self.buffer.ack([entry], trained=False)
        self.learner.state.groups_dropped_stale += 1
        self._dropped_since_step += 1
        log.warning("dropping group %s (entry %s): sampled by policy version %d, the learner is at %d "
                    "(max_staleness %d)", entry.group.group_id, entry.entry_id, oldest, version, k)
        return True

    def _roll_back(self, collected: list, pending: list) -> bool:
        """A step raised: with one rank and a checkpoint to return to, restores it, takes the
        unacknowledged entries back from the buffer (redelivered, their delivery count up by
        one) and returns True; otherwise False (the caller re-raises: the process ends)."""
        learner = self.learner
        if learner.world > 1 or self.buffer is None or latest_checkpoint(learner.cfg.run_dir) is None:
            return False
        self.step_failures += 1
        log.exception("learner step %d raised (groups %s): rolling back to the latest checkpoint; its groups are "
                      "delivered again, and one delivered more than %d times is dead-lettered", learner.state.step + 1,
                      [e.group.group_id for e, _ in collected], self.buffer.max_deliveries)
        learner.optimizer.zero_grad(set_to_none=True)
        load_checkpoint(learner)
        collected.clear()
        pending.clear()
        self.buffer.take_back(learner.cfg.buffer.consumer)
        return True

    def _broadcast(self, tick: Tick | None) -> Tick:
        if self.learner.world == 1:
            assert tick is not None
            return tick
        box = [tick]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _checkpoint_and_ack(self, pending: list) -> None:
        path = save_checkpoint(self.learner)
        self.last_checkpoint = str(path)
        if self.learner.rank == 0:
            if pending:
                self.buffer.ack(pending)
                pending.clear()
            with self._lock:
                waiters, self._ckpt_waiters = self._ckpt_waiters, []
            s = self.learner.state
            for fut in waiters:
                fut.set_result((str(path), s.policy_version, s.step))

    def _warm_start(self) -> None:
        """Supervised warm start (learner_service/sft.py), checkpointed and published as the next version."""
        from learner_service.sft import read_demonstrations, warm_start

        groups = read_demonstrations(self.learner.cfg.warm_start.demonstrations)
        metrics = warm_start(self.learner, groups)
        save_checkpoint(self.learner)
        published = publish_policy(self.learner)
        log.info("warm start done: policy version %d at %s (%s)", published.policy_version, published.location,
                 ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))

    def _load_reference(self, version: int) -> None:
        """Loads published policy `version` (safetensors) as the learner's KL reference. Collective."""
        learner = self.learner
        folder = policy_dir(learner.cfg.run_dir, version)
        sd: dict = {}
        if learner.rank == 0 or learner.world == 1:
            from safetensors.torch import load_file

            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"KL reference: no safetensors in {folder} (the warm-start policy version {version})")
            for f in files:
                sd.update(load_file(str(f)))
        learner.set_reference(sd, version)

    def run(self, max_steps: int | None = None) -> int:
        """Trains until `max_steps` learner steps in total (None: until `request_stop`).

        Returns:
            the learner's step count at exit. A final checkpoint is written (and its groups
            acknowledged) before returning.
        """
        learner, cfg = self.learner, self.learner.cfg
        if learner.rank == 0 and learner.state.trained_group_ids:
            self.buffer.mark_trained(learner.state.trained_group_ids)
        if cfg.warm_start.demonstrations and learner.state.policy_version == 0 and not self._stop.is_set():
            self._warm_start()
        ws = learner.state.warm_start_version
        if learner.ref_model is not None and ws > 0 and learner.reference_version != ws:
            self._load_reference(ws)  # resumed after the warm start: π_ref is the warm-start policy
        v = learner.state.policy_version
        # rank 0 decides for every rank (publishing is collective; another rank may look at the
        # folder before rank 0 has renamed it into place)
        unpublished = [v > 0 and not policy_dir(cfg.run_dir, v).is_dir()]
        if learner.world > 1:
            dist.broadcast_object_list(unpublished, src=0)
        if unpublished[0]:
            publish_policy(learner)  # crashed between checkpoint and publish
        else:
            learner.state.published_version = v
            learner.state.published_location = str(policy_dir(cfg.run_dir, v).resolve()) if v > 0 else (cfg.model.path or "")
        collected: list = []  # rank 0: (entry, Group) read, not yet trained
        pending: list = []  # rank 0: entries trained, not yet acknowledged
        dirty = False  # trained since the last checkpoint
        loop_start = time.monotonic()
        last_end: float | None = None  # when the last step's checkpoint/publish ended
        idle_total = busy_total = 0.0  # since the first step started
        while max_steps is None or learner.state.step < max_steps:
            tick = self._broadcast(self._next_tick(collected) if learner.rank == 0 else None)
            if tick.stop:
                if dirty or tick.checkpoint:
                    self._checkpoint_and_ack(pending)
                    dirty = False
                break
            t_step = time.monotonic()
            if tick.groups:
                idle = t_step - (loop_start if last_end is None else last_end)
                extra = {"learner_idle_s": idle, "dropped_stale_groups": float(self._dropped_since_step),
                         "dropped_stale_groups_total": float(learner.state.groups_dropped_stale),
                         "max_staleness": float(-1 if cfg.max_staleness is None else cfg.max_staleness)}
                if last_end is not None:
                    idle_total += idle
                    extra["learner_idle_fraction"] = idle_total / max(idle_total + busy_total, 1e-9)
                extra["dead_lettered_groups"] = float(self._dead_since_step)
                self._dropped_since_step = self._dead_since_step = 0
                if cfg.step_delay_s:
                    time.sleep(cfg.step_delay_s)  # a learner slowed on purpose (tests, benchmarks)
                extra["dead_lettered_groups_total"] = float(self.dead_lettered)
                try:
                    metrics = learner.train_step(tick.groups, extra)
                except Exception:
                    if not self._roll_back(collected, pending):
                        raise
                    dirty = False
                    continue
                if self.on_step is not None and learner.rank == 0:
                    self.on_step(metrics)
                pending.extend(e for e, _ in collected)
                collected.clear()
                dirty = True
            # a version is published only once its checkpoint is durable
            publish = bool(tick.groups) and learner.state.step % cfg.publish_every == 0 and \
                learner.state.published_version != learner.state.policy_version
            if tick.checkpoint or (dirty and tick.groups and (learner.state.step % cfg.checkpoint_every == 0 or publish)):
                self._checkpoint_and_ack(pending)
                dirty = False
            if publish:
                publish_policy(learner)
            if tick.groups:
                last_end = time.monotonic()
                busy_total += last_end - t_step
        if dirty:
            self._checkpoint_and_ack(pending)
        with self._lock:
            waiters, self._ckpt_waiters = self._ckpt_waiters, []
        for fut in waiters:
            fut.set_exception(RuntimeError("learner stopped before the checkpoint was written"))
        return learner.state.step


def _vocab_size(model) -> int:
    """Rows of the model's input embedding (the token ids it can look up)."""
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, TypeError):
        return int(model.config.vocab_size)
