"""A discrete-event simulator of RL post-training that runs rollkit's *real* scheduling code.

The queue scheduler (:class:`trainers.loops.queue.QueueScheduler`), the freshness-bounded
:class:`rollkit.buffer.SampleBuffer` and the tail-batching collector
(:class:`trainers.loops.collect.TailCollector` with :class:`rollkit.scheduling.TailBatchingPolicy`)
drive simulated rollout engines (:class:`benchmarks.sim.engine.SimEngine`, the real
``RequestEngine`` protocol), reward workers, a trainer and weight syncs on a virtual clock; the
times come from the cost models of :mod:`benchmarks.sim.costs`. Design, calibration and the
papers' tables: docs/simulator.md. Nothing in ``rollkit/`` or ``trainers/`` imports this package.
"""
