"""Peak resident memory of a block of code, sampled every millisecond (shared by the eager benchmarks)."""

import threading
import time

import psutil


class PeakMemory:
    """`start`: the resident set on entry; `high`: the most seen inside; `peak`: how far above `start` it rose."""

    def __enter__(self):
        self.process = psutil.Process()
        self.start = self.high = self.process.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.high = max(self.high, self.process.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.high = max(self.high, self.process.memory_info().rss)

    @property
    def peak(self) -> int:
        return self.high - self.start
