"""A fake Kubernetes API server: the apps/v1 Deployment scale subresource over real HTTP on
loopback (no Kubernetes API server runs here; the official client talks to this one)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeKube:
    """The apps/v1 Deployment scale subresource: GET and PATCH, 404 for unknown names."""

    def __init__(self, deployments: dict[str, int]) -> None:
        self.replicas, self.patches = dict(deployments), []
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _name(self):
                parts = self.path.split("?")[0].strip("/").split("/")
                # apis/apps/v1/namespaces/NS/deployments/NAME/scale
                ok = parts[:3] == ["apis", "apps", "v1"] and parts[-1] == "scale"
                return (parts[4], parts[6]) if ok and len(parts) == 8 else (None, None)

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _scale(self, ns, name):
                n = fake.replicas[name]
                return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                        "metadata": {"name": name, "namespace": ns},
                        "spec": {"replicas": n}, "status": {"replicas": n}}

            def _missing(self, name):
                self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                 "message": f'deployments.apps "{name}" not found',
                                 "reason": "NotFound", "code": 404})

            def do_GET(self):
                ns, name = self._name()
                if name not in fake.replicas:
                    return self._missing(name)
                self._send(200, self._scale(ns, name))

            def do_PATCH(self):
                ns, name = self._name()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.patches.append((name, self.headers["Content-Type"], body))
                if name not in fake.replicas:
                    return self._missing(name)
                fake.replicas[name] = body["spec"]["replicas"]
                self._send(200, self._scale(ns, name))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
