"""Check that a C++ call releases the GIL: the main thread keeps running while it works."""
import threading
import time


def longest_main_thread_stall(work) -> tuple[float, float]:
    """Run work() in a thread; return (longest gap between main-thread steps, work duration)."""
    thread = threading.Thread(target=work)
    start = last = time.perf_counter()
    thread.start()
    longest = 0.0
    while thread.is_alive():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    return longest, time.perf_counter() - start
