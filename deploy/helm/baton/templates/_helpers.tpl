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
