{{/* A pool's KEDA ScaledObject: the pool scales on Baton's own metrics, read from Prometheus
     (the chart's PodMonitor and ServiceMonitor feed it), not on CPU. The signals are the SLO
     autoscaler's (control/autoscale.py): prefill on its queue per worker and the time to first
     token less the decode-slot wait; decode on its queue per worker (the routers' decode-slot
     queues with its own), its KV usage, the decode-slot wait and TPOT. Each trigger asks for
     the replicas that bring its figure to its target; KEDA takes the most. */}}
{{- define "baton.scaledObject" -}}
{{- $ := .ctx -}}
{{- $pool := .pool -}}
{{- $a := (index $.Values $pool).autoscaling -}}
{{- $full := include "baton.fullname" $ -}}
{{- $prom := required (printf "%s.autoscaling.enabled: set %s.autoscaling.prometheus (the Prometheus KEDA reads Baton's metrics from, e.g. http://prometheus.monitoring:9090)" $pool $pool) $a.prometheus -}}
{{- $pods := printf "namespace=%q,pod=~%q" $.Release.Namespace (printf "%s-%s-.*" $full $pool) -}}
{{- $router := printf "namespace=%q,pod=~%q" $.Release.Namespace (printf "%s-router-.*" $full) -}}
{{- $p90 := "histogram_quantile(0.9, sum by (le) (rate(%s_bucket{%s}[2m])))" -}}
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: {{ $full }}-{{ $pool }}
  labels: {{- include "baton.labels" $ | nindent 4 }}
    app.kubernetes.io/component: {{ $pool }}
spec:
  scaleTargetRef:
    name: {{ $full }}-{{ $pool }}
  minReplicaCount: {{ $a.minReplicas }}
  maxReplicaCount: {{ $a.maxReplicas }}
  pollingInterval: 15
  advanced:
    horizontalPodAutoscalerConfig:
      behavior:   # scale down slowly: a drained worker finishes its requests first
        scaleDown:
          stabilizationWindowSeconds: 300
          policies: [{type: Pods, value: 1, periodSeconds: 120}]
  triggers:
    - type: prometheus   # requests waiting per worker
      metricType: AverageValue
      metadata:
        serverAddress: {{ $prom | quote }}
        {{- if eq $pool "prefill" }}
        query: {{ printf "sum(baton_worker_queue_depth{%s})" $pods | quote }}
        {{- else }}
        query: {{ printf "(sum(vllm:num_requests_waiting{%s}) or vector(0)) + (sum(baton_router_decode_queued{%s}) or vector(0))" $pods $router | quote }}
        {{- end }}
        threshold: {{ $a.queueTarget | quote }}
    {{- if eq $pool "prefill" }}
    - type: prometheus   # time to first token less the decode-slot wait, p90
      metricType: Value
      metadata:
        serverAddress: {{ $prom | quote }}
        query: {{ printf $p90 "baton_ttft_prefill_side_seconds" $router | quote }}
        threshold: {{ $a.ttftSlo | quote }}
    {{- else }}
    - type: prometheus   # share of the KV pool in use
      metricType: Value
      metadata:
        serverAddress: {{ $prom | quote }}
        query: {{ printf "avg(vllm:kv_cache_usage_perc{%s})" $pods | quote }}
        threshold: {{ $a.kvTarget | quote }}
    - type: prometheus   # the wait for a decode slot, p90
      metricType: Value
      metadata:
        serverAddress: {{ $prom | quote }}
        query: {{ printf $p90 "baton_ttft_phase_seconds" (printf "%s,phase=\"decode_wait\"" $router) | quote }}
        threshold: {{ $a.ttftSlo | quote }}
    - type: prometheus   # time per output token, p90
      metricType: Value
      metadata:
        serverAddress: {{ $prom | quote }}
        query: {{ printf $p90 "baton_time_per_output_token_seconds" $router | quote }}
        threshold: {{ $a.tpotSlo | quote }}
    {{- end }}
{{- end -}}
