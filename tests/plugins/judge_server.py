"""A real OpenAI-compatible chat-completions server on loopback, for the vlm_judge tests.

Run as ``python judge_server.py``: prints its port, then serves until killed. It grades an image by
its mean brightness (0-10), a text answer by its number of words (at most 10). Words in the rubric's prompt choose a misbehaviour:
``slow`` sleeps 3 s; ``flaky`` answers HTTP 500 to the first request for that prompt; ``busy``
answers 429 once; ``garbage`` answers prose without a number; ``badrequest`` answers 400.
A question that asks for a score "after 'Final Score:'" (UnifiedReward's) is answered as UnifiedReward answers:
an "element (type): 0/1" line, then "Final Score: X" with X the brightness on 1-5 (half the 0-10 grade, at least 1);
its ``garbage`` answer has the element line and no final score. The prompt is the question's "Text Caption: [...]".
``GET /stats`` reports the request count and the most requests ever in flight at once; ``GET /received``
the last message content received for each prompt.
"""

from __future__ import annotations

import base64
import io
import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from PIL import Image

lock = threading.Lock()
stats = {"requests": 0, "in_flight": 0, "max_in_flight": 0}
seen: dict[str, int] = {}
received: dict[str, list] = {}


class Judge(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep the test output clean
        pass

    def reply(self, code: int, body: dict | str) -> None:
        data = (json.dumps(body) if isinstance(body, dict) else body).encode()
        if self.command == "POST":  # done working: the client may send its next request once it reads this
            with lock:
                stats["in_flight"] -= 1
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        with lock:
            self.reply(200, dict(received) if self.path == "/received" else dict(stats))

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        content = request["messages"][0]["content"]
        text = next(part["text"] for part in content if part["type"] == "text")
        url = next((part["image_url"]["url"] for part in content if part["type"] == "image_url"), None)
        unified = "after 'Final Score:'" in text
        if unified:
            prompt = re.search(r"Text Caption: \[(.*)\]$", text).group(1)
        else:
            prompt = re.search(r'"(.*)"', text).group(1) if url else re.search(r"Request: (.*)", text).group(1)
        with lock:
            received[prompt] = content
            stats["requests"] += 1
            stats["in_flight"] += 1
            stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
            attempt = seen[prompt] = seen.get(prompt, 0) + 1
        time.sleep(0.05)  # a little work, so concurrent requests overlap
        if "slow" in prompt:
            time.sleep(3)
        if "badrequest" in prompt:
            return self.reply(400, {"error": "unknown model"})
        if "flaky" in prompt and attempt == 1:
            return self.reply(500, {"error": "internal"})
        if "busy" in prompt and attempt == 1:
            return self.reply(429, {"error": "rate limited"})
        if url is None:  # a text answer: its grade is the number of words in it, at most 10
            score = min(len(re.search(r"Answer: (.*)", text).group(1).split()), 10)
        else:
            image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
            score = round(float(np.asarray(image, dtype=np.float32).mean() / 255 * 10), 1)
        if unified:
            final = "" if "garbage" in prompt else f"\nFinal Score: {max(score / 2, 1.0)}"
            answer = f"{prompt.split()[-1]} (object): 1{final}"
        else:
            answer = "I would rather not say." if "garbage" in prompt else f"{score}"
        self.reply(200, {"choices": [{"message": {"role": "assistant", "content": answer}}]})


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    print(server.server_address[1], flush=True)
    sys.stdout.close()
    server.serve_forever()
