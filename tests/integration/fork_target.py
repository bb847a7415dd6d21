"""A module the fork server tests run as ``__main__``: it reports what it was given, then does
what its first argument says."""

import os
import signal
import sys
import time

if __name__ == "__main__":
    print(f"argv={sys.argv[1:]} cwd={os.getcwd()} env={os.environ.get('RLH_FORK_PROBE')} "
          f"sid={os.getsid(0)} pid={os.getpid()} main={__name__}", flush=True)
    action = sys.argv[1]
    if action == "exit":
        sys.exit(int(sys.argv[2]))
    if action == "raise":
        raise ValueError("the module failed")
    if action == "thread":  # main returns while a non-daemon thread still works
        import threading

        def late() -> None:
            time.sleep(0.3)
            print("thread done", flush=True)

        threading.Thread(target=late).start()
        sys.exit(0)
    if action == "serve":  # until SIGTERM, which it handles gracefully
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            time.sleep(0.05)
