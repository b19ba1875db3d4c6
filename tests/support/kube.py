"""A fake Kubernetes API server over real HTTP on loopback (no Kubernetes API server runs here;
the official client talks to this one): the apps/v1 Deployment, its scale subresource, and the
Deployment's pods (list by label selector, patch), with a ReplicaSet's choice on scale-down:
the lowest ``controller.kubernetes.io/pod-deletion-cost`` first, then the newest."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

COST = "controller.kubernetes.io/pod-deletion-cost"


class FakeKube:
    """Deployments by name with their replica counts; each replica a pod ``NAME-i`` with IP
    ``10.9.<d>.<i>``, created in order. ``patches`` records scale patches, ``deleted`` the pods
    a scale-down removed."""

    def __init__(self, deployments: dict[str, int]) -> None:
        self.replicas, self.patches = dict(deployments), []
        self.deleted: list[str] = []
        self.pods: dict[str, list[dict]] = {d: [] for d in deployments}
        self._made = 0
        for d, n in deployments.items():
            for _ in range(n):
                self._add_pod(d)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _add_pod(self, dep: str) -> None:
        self._made += 1
        d = list(self.replicas).index(dep)
        self.pods[dep].append({"name": f"{dep}-{self._made}", "ip": f"10.9.{d}.{self._made}",
                               "created": self._made, "annotations": {}})

    def _resize(self, dep: str, n: int) -> None:
        pods = self.pods[dep]
        while len(pods) < n:
            self._add_pod(dep)
        if len(pods) > n:
            ranked = sorted(pods, key=lambda p: (int(p["annotations"].get(COST, "0")),
                                                 -p["created"]))
            for p in ranked[:len(pods) - n]:
                pods.remove(p)
                self.deleted.append(p["name"])
        self.replicas[dep] = n

    def pod_ip(self, name: str) -> str:
        return next(p["ip"] for ps in self.pods.values() for p in ps if p["name"] == name)

    def _handler(self):
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _missing(self, what):
                self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                 "message": f"{what} not found", "reason": "NotFound",
                                 "code": 404})

            def _body(self):
                return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

            def do_GET(self):
                parts, query = _route(self.path)
                if parts[:2] == ["api", "v1"] and parts[-1] == "pods":
                    sel = query.get("labelSelector", [""])[0].split("=")[-1]
                    return self._send(200, {"apiVersion": "v1", "kind": "PodList",
                                            "metadata": {}, "items": [
                                                _pod(sel, p) for p in fake.pods.get(sel, [])]})
                name = parts[6] if len(parts) > 6 else None
                if name not in fake.replicas:
                    return self._missing(f'deployments.apps "{name}"')
                if parts[-1] == "scale":
                    return self._send(200, _scale(parts[4], name, fake.replicas[name]))
                self._send(200, _deployment(parts[4], name, fake.replicas[name]))

            def do_PATCH(self):
                parts, _ = _route(self.path)
                body = self._body()
                if parts[:2] == ["api", "v1"] and parts[-2] == "pods":
                    pod = next((p for ps in fake.pods.values() for p in ps
                                if p["name"] == parts[-1]), None)
                    if pod is None:
                        return self._missing(f'pods "{parts[-1]}"')
                    for k, v in body.get("metadata", {}).get("annotations", {}).items():
                        if v is None:
                            pod["annotations"].pop(k, None)
                        else:
                            pod["annotations"][k] = v
                    dep = next(d for d, ps in fake.pods.items() if pod in ps)
                    return self._send(200, _pod(dep, pod))
                name = parts[6] if len(parts) > 6 else None
                fake.patches.append((name, self.headers["Content-Type"], body))
                if name not in fake.replicas:
                    return self._missing(f'deployments.apps "{name}"')
                fake._resize(name, body["spec"]["replicas"])
                self._send(200, _scale(parts[4], name, fake.replicas[name]))

        return H

    def close(self):
        self.server.shutdown()


def _route(path: str) -> tuple[list[str], dict]:
    u = urlparse(path)
    return u.path.strip("/").split("/"), parse_qs(u.query)


def _scale(ns: str, name: str, n: int) -> dict:
    return {"apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"replicas": n}, "status": {"replicas": n}}


def _deployment(ns: str, name: str, n: int) -> dict:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"replicas": n, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [{"name": "worker",
                                                           "image": "baton"}]}}}}


def _pod(dep: str, p: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": p["name"], "labels": {"app": dep},
                         "annotations": dict(p["annotations"]),
                         "creationTimestamp": f"2026-11-26T00:00:{p['created']:02d}Z"},
            "status": {"podIP": p["ip"]}}
