"""A discrete-event model of the fused kernel's producer/consumer barrier protocol (kernels/cuda:
producer.cuh, consumer.cuh, smem.cuh), run with random latencies, for each layout:

  solo    one CTA per chain: producers 0 and 1 prepare chunks n = 2k + p into stage n % 3
  paired  two CTAs per chain: producer (rank, w) prepares n = 4k + 2 rank + w into stage n % 4 of
          its CTA, then bulk-copies it into the peer's (arrive.expect_tx, the copy's complete_tx,
          255 more arrivals); each CTA's consumer arrives on both CTAs' empty barriers

It models mbarriers as the hardware keeps them (phase, pending arrivals, transaction bytes; a parity
wait passes when the current phase's parity differs) and checks that every consumer reads every chunk
in order with the right contents (the last one is END), that no stage is written while a consumer
reads it, that no barrier gets more arrivals than its count, and that nothing deadlocks.  A change
to the protocol (stages, strides, who waits on what) should be tried here first.

    python3 scripts/dev/pipeline-model.py

The stage counts, strides and barrier counts are read from the kernel's sources (kernel_constants),
so the model fails when they change and it is not changed with them; ctest runs it (pipeline_model).
"""
import heapq
import os
import random
import re

KERNEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "kernels", "cuda")


def kernel_constants():
    """The protocol's numbers as smem.cuh and producer.cuh define them."""
    def grab(name, pattern):
        with open(os.path.join(KERNEL, name)) as f:
            m = re.search(pattern, f.read())
        assert m, f"{name}: no match for {pattern!r}: update the model with the kernel"
        return m.groups()
    paired_stages, solo_stages = grab("smem.cuh", r"prep_stages\(bool paired\) \{ return paired \? (\d+) : (\d+); \}")
    (wg,) = grab("smem.cuh", r"constexpr int WG_THREADS = (\d+);")
    full, empty = grab("smem.cuh", r"FULL_ARRIVALS = (\d+) \* WG_THREADS;[\s\S]*EMPTY_ARRIVALS = WG_THREADS \* (\w+);")
    (consumers,) = grab("smem.cuh", r"constexpr int %s = (\d+);" % empty)
    paired_stride, solo_stride = grab("producer.cuh", r"STRIDE = PAIRED \? (\d+) : (\d+);")
    return {"stages": {"paired": int(paired_stages), "solo": int(solo_stages)},
            "stride": {"paired": int(paired_stride), "solo": int(solo_stride)},
            "wg": int(wg), "full": int(full) * int(wg), "empty": int(wg) * int(consumers)}


K = kernel_constants()


class Bar:
    def __init__(self, name, count):
        self.name, self.count, self.pending, self.phase, self.tx = name, count, count, 0, 0

    def arrive(self, n=1, tx=0):
        self.tx += tx
        self.pending -= n
        assert self.pending >= 0, f"over-arrival on {self.name} in phase {self.phase}"
        self._complete()

    def complete_tx(self, nbytes):
        self.tx -= nbytes
        self._complete()

    def _complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def passed(self, parity):          # mbarrier.try_wait.parity
        return (self.phase & 1) != parity


class Sim:
    def __init__(self, seed):
        self.rnd, self.events, self.now, self.seq = random.Random(seed), [], 0.0, 0

    def at(self, dt, fn):
        self.seq += 1
        heapq.heappush(self.events, (self.now + dt, self.seq, fn))

    def wait(self, bar, parity, then):
        def poll():
            if bar.passed(parity):
                then()
            else:
                self.at(self.rnd.uniform(0.01, 0.2), poll)
        poll()

    def run(self):
        steps = 0
        while self.events:
            self.now, _, fn = heapq.heappop(self.events)
            fn()
            steps += 1
            assert steps < 3_000_000, "no end: a wait never passes (deadlock)"


def model(layout, total, seed):
    sim = Sim(seed)
    rnd = sim.rnd
    ctas = 2 if layout == "paired" else 1
    stages = K["stages"][layout]
    producers = [(r, w) for r in range(ctas) for w in range(2)]
    stride = len(producers)
    assert stride == K["stride"][layout], f"{layout}: the kernel's producers stride {K['stride'][layout]}"
    full = [[Bar(f"full{r}.{s}", K["full"]) for s in range(stages)] for r in range(ctas)]
    empty = [[Bar(f"empty{r}.{s}", K["empty"]) for s in range(stages)] for r in range(ctas)]
    stage = [[None] * stages for _ in range(ctas)]
    reading = [[None] * stages for _ in range(ctas)]
    content = lambda n: "END" if n == total else n

    def write(r, s, n):
        assert reading[r][s] is None, f"stage {r}.{s} written with chunk {n} while chunk {reading[r][s]} is read"
        stage[r][s] = content(n)

    def producer(r, w, k):
        n = stride * k + (2 * r + w if layout == "paired" else w)
        if n > total:
            return                                            # past the END chunk
        s = n % stages

        def stage_free():
            write(r, s, n)
            def prepared():
                full[r][s].arrive(K["wg"])                     # the warpgroup's threads
                sim.at(rnd.uniform(0, 1), lambda: full[r][s].arrive(K["full"] - K["wg"]))   # its value copies
                if layout == "paired":                         # thread 0, once the stage is complete
                    def complete():
                        peer = r ^ 1
                        full[peer][s].arrive(1, tx=1000)
                        data = stage[r][s]
                        def landed():
                            assert reading[peer][s] is None, f"copy of chunk {n} lands while {reading[peer][s]} is read"
                            stage[peer][s] = data
                            full[peer][s].complete_tx(1000)
                        sim.at(rnd.uniform(0.1, 2), landed)
                        full[peer][s].arrive(K["full"] - 1)
                    sim.wait(full[r][s], (n // stages) & 1, complete)
                if n < total:
                    producer(r, w, k + 1)
            sim.at(rnd.uniform(0.5, 3), prepared)
        sim.wait(empty[r][s], ((n // stages) & 1) ^ 1, stage_free)

    got = {}

    def consumer(r, wg, n):
        s = n % stages
        def full_ok():
            c = stage[r][s]
            got.setdefault((r, wg), []).append(c)
            assert c == content(n), f"consumer {r}.{wg} read {c} for chunk {n}"
            if c == "END":
                return
            if wg == 0:
                reading[r][s] = n
            def done():
                if wg == 0:
                    reading[r][s] = None
                arrivals = K["wg"]                            # a consumer warpgroup's threads
                for cta in range(ctas):                       # paired: both CTAs' empty barriers
                    empty[cta][s].arrive(arrivals)
                consumer(r, wg, n + 1)
            sim.at(rnd.uniform(0.5, 1.5), done)
        sim.wait(full[r][s], (n // stages) & 1, full_ok)

    for r, w in producers:
        producer(r, w, 0)
    consumer_wgs = [(r, 0) for r in range(ctas)] if layout == "paired" else [(0, 0), (0, 1)]
    for r, wg in consumer_wgs:
        consumer(r, wg, 0)
    sim.run()
    for key in consumer_wgs:
        assert got.get(key) == [content(n) for n in range(total + 1)], f"consumer {key} stopped early"


if __name__ == "__main__":
    for layout in ("solo", "paired"):
        runs = 0
        for total in list(range(0, 20)) + [37, 100, 257]:
            for seed in range(30 if total < 40 else 6):
                model(layout, total, seed)
                runs += 1
        print(f"{layout}: {runs} runs with random latencies: every chunk in order, no stage reused early, "
              f"no over-arrival, no deadlock")
