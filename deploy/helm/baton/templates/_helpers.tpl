{{- define "baton.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "baton.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* selector labels of one component: (dict "ctx" $ "component" "router") */}}
{{- define "baton.selector" -}}
app.kubernetes.io/name: {{ .ctx.Chart.Name }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "baton.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{/* the Secrets the chart makes (or the user names) */}}
{{- define "baton.redisAuthSecret" -}}
{{ .Values.redis.auth.existingSecret | default (printf "%s-redis-auth" (include "baton.fullname" .)) }}
{{- end -}}
{{- define "baton.clusterSecretName" -}}
{{ .Values.clusterSecret.existingSecret | default (printf "%s-cluster-secret" (include "baton.fullname" .)) }}
{{- end -}}

{{/* env REDIS_PASSWORD (in-chart Redis) for Redis itself and for BATON_REDIS_URL */}}
{{- define "baton.redisPasswordEnv" -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ include "baton.redisAuthSecret" . | quote }}, key: password}
{{- end -}}

{{/* env BATON_CLUSTER_SECRET: every worker requires it on its gRPC calls, routers send it */}}
{{- define "baton.clusterSecretEnv" -}}
{{- if .Values.clusterSecret.enabled }}
- name: BATON_CLUSTER_SECRET
  valueFrom:
    secretKeyRef: {name: {{ include "baton.clusterSecretName" . | quote }}, key: secret}
{{- end }}
{{- end -}}

{{/* env BATON_REDIS_URL, from the in-chart Redis (its password from the chart's Secret, put
     in by Kubernetes' $(VAR) expansion: in the environment, never in argv), an external URL,
     or a Secret */}}
{{- define "baton.redisEnv" -}}
{{- $r := .Values.redis -}}
{{- if $r.enabled }}
{{ include "baton.redisPasswordEnv" . }}
{{- end }}
- name: BATON_REDIS_URL
{{- if $r.enabled }}
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s-redis:%d/0" (include "baton.fullname" .) (int $r.port) | quote }}
{{- else if $r.external.urlSecret.name }}
  valueFrom:
    secretKeyRef: {name: {{ $r.external.urlSecret.name | quote }}, key: {{ $r.external.urlSecret.key | quote }}}
{{- else }}
  value: {{ required "redis.enabled is false: set redis.external.url or redis.external.urlSecret.name" $r.external.url | quote }}
{{- end }}
{{- end -}}

{{- define "baton.otelEnv" -}}
{{- if .Values.otel.enabled }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ required "otel.enabled: set otel.endpoint" .Values.otel.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .Values.otel.protocol | quote }}
{{- range $k, $v := .Values.otel.extraEnv }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "baton.modelArgs" -}}
{{- if .Values.model.path }}
- --model
- {{ .Values.model.path | quote }}
{{- end }}
- --dtype
- {{ .Values.model.dtype | quote }}
- --block-size
- {{ .Values.model.blockSize | quote }}
{{- end -}}

{{/* a Baton pod's securityContext: non-root (or root for an RDMA profile that asks: (dict
     "ctx" $ "root" true)) */}}
{{- define "baton.podSecurityContext" -}}
{{- $s := .ctx.Values.podSecurity -}}
{{- if .root }}
runAsNonRoot: false
runAsUser: 0
runAsGroup: 0
{{- else }}
runAsNonRoot: true
runAsUser: {{ $s.runAsUser }}
runAsGroup: {{ $s.runAsGroup }}
{{- end }}
fsGroup: {{ $s.fsGroup }}
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{/* a Baton container's securityContext: no privilege escalation, no capabilities (IPC_LOCK
     for root RDMA workers: unlimited locked memory), read-only root filesystem */}}
{{- define "baton.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: {{ .ctx.Values.podSecurity.readOnlyRootFilesystem }}
capabilities:
  drop: [ALL]
  {{- if .root }}
  add: [IPC_LOCK]
  {{- end }}
{{- end -}}

{{/* what a Baton process writes, with the root filesystem read-only: /tmp, the Baton cache
     (converted weights, native kernels) and Triton's cache under it; HOME has none otherwise */}}
{{- define "baton.writableEnv" -}}
- {name: HOME, value: /tmp}
- {name: BATON_CACHE_DIR, value: /var/cache/baton}
- {name: TRITON_CACHE_DIR, value: /var/cache/baton/triton}
{{- end -}}
{{- define "baton.writableMounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: cache, mountPath: /var/cache/baton}
{{- end -}}
{{- define "baton.writableVolumes" -}}
- {name: tmp, emptyDir: {}}
- {name: cache, emptyDir: {}}
{{- end -}}

{{/* a worker pod's memory (request and limit), from the model: (dict "ctx" $ "p" $p). GiB:
     weightsGb + kvCacheGb (CPU pools) + the host KV tier (GPU pools; default 4) +
     memoryOverheadGb, as Mi rounded up */}}
{{- define "baton.workerMemory" -}}
{{- $p := .p -}}
{{- $gb := float64 .ctx.Values.model.weightsGb -}}
{{- if gt (int $p.gpus) 0 -}}
{{- $host := ternary 4 $p.kvTiers.hostGb (kindIs "invalid" $p.kvTiers.hostGb) -}}
{{- $gb = addf $gb (float64 $host) -}}
{{- else -}}
{{- $gb = addf $gb (float64 $p.kvCacheGb) -}}
{{- end -}}
{{- $gb = addf $gb (float64 $p.memoryOverheadGb) -}}
{{- printf "%dMi" (int (ceil (mulf $gb 1024))) -}}
{{- end -}}
