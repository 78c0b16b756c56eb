"""How long `/livez` stalls while one large request is processed (issue 12 item 2): a real
uvicorn in a thread on fake workers (the fake tokenizer is a real `tokenizers` WordLevel one),
a request posted from another thread, `/livez` probed every 20 ms until it is answered; prints
the slowest probe. Seconds to run.

    python bench/livez_stall.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per request kind (default 3)")
    ap.add_argument("--words", type=int, default=440_000,
                    help="words in the classify document (default 440000: 1.94 MB, 413 on tokens)")
    ap.add_argument("--keys", type=int, default=500_000, help="keys in the hostile JSON object (default 500000)")
    args = ap.parse_args()

    import httpx
    import uvicorn

    from longdoc.service.app import create_app
    from longdoc.service.settings import Settings
    from longdoc.testing.fake_worker import FakeWorker

    app = create_app(Settings(models={"cls": "classify"}, warmup=False),
                     worker_factory=lambda name, directory, device, settings: FakeWorker(name, str(directory)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

    def stall(body: bytes) -> tuple[int, float, int]:
        box, done = {}, threading.Event()

        def post():
            box["r"] = httpx.post(url + "/v1/classify", content=body, timeout=60,
                                  headers={"content-type": "application/json"})
            done.set()

        worst, probes = 0.0, 0
        with httpx.Client(base_url=url, timeout=30) as client:
            threading.Thread(target=post).start()
            while not done.wait(0.02):
                start = time.monotonic()
                client.get("/livez")
                worst, probes = max(worst, time.monotonic() - start), probes + 1
        return box["r"].status_code, worst, probes

    document = json.dumps({"document": " ".join(f"w{i % 200}" for i in range(args.words))}).encode()
    keys = json.dumps({f"k{i}": 1 for i in range(args.keys)}).encode()
    for name, body in ((f"{len(document) / 1e6:.2f} MB document", document), (f"{args.keys} keys", keys)):
        for _ in range(args.rounds):
            status, worst, probes = stall(body)
            print(f"{name}: {status}, slowest /livez {worst:.3f} s over {probes} probes")
    server.should_exit = True


if __name__ == "__main__":
    main()
