{{/* Names and labels shared by every object of the chart. */}}

{{- define "prefix-proxy.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-prefix-proxy, or the release name alone when it already contains the chart's name. */}}
{{- define "prefix-proxy.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "prefix-proxy.selectorLabels" -}}
app.kubernetes.io/name: {{ include "prefix-proxy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "prefix-proxy.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "prefix-proxy.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: prefix-proxy
{{- end }}

{{/* The Secret the chart creates for what the values give inline (API keys, tenants, Redis URL). */}}
{{- define "prefix-proxy.secretName" -}}
{{- include "prefix-proxy.fullname" . }}
{{- end }}

{{/* Where each secret value comes from: an existing Secret when named, else the chart's own. */}}
{{- define "prefix-proxy.apiKeysSecret" -}}
{{- .Values.apiKeys.existingSecret | default (include "prefix-proxy.secretName" .) }}
{{- end }}

{{- define "prefix-proxy.tenantsSecret" -}}
{{- .Values.tenants.existingSecret | default (include "prefix-proxy.secretName" .) }}
{{- end }}

{{- define "prefix-proxy.tenantsKey" -}}
{{- if .Values.tenants.existingSecret }}{{ .Values.tenants.existingSecretKey }}{{ else }}tenants.json{{ end }}
{{- end }}

{{- define "prefix-proxy.redisSecret" -}}
{{- .Values.redis.existingSecret | default (include "prefix-proxy.secretName" .) }}
{{- end }}

{{- define "prefix-proxy.redisUrlKey" -}}
{{- if .Values.redis.existingSecret }}{{ .Values.redis.urlKey }}{{ else }}redis-url{{ end }}
{{- end }}

{{/* "true" when the session store is a Redis of any topology. */}}
{{- define "prefix-proxy.usesRedis" -}}
{{- if ne .Values.sessionStore "memory" }}true{{ end }}
{{- end }}

{{/* "true" when the chart has anything to put in a Secret of its own. */}}
{{- define "prefix-proxy.createsSecret" -}}
{{- if or (not .Values.apiKeys.existingSecret) (and .Values.tenants.items (not .Values.tenants.existingSecret)) (and (include "prefix-proxy.usesRedis" .) (not .Values.redis.existingSecret)) }}true{{ end }}
{{- end }}

{{/* config.yaml: the values' settings with what the chart owns (upstreams, session store, readiness) set on top. */}}
{{- define "prefix-proxy.config" -}}
{{- $config := deepCopy .Values.config }}
{{- if eq (len .Values.upstreams) 1 }}
{{- $_ := set $config "upstream" (first .Values.upstreams) }}
{{- else }}
{{- $_ := set $config "upstreams" .Values.upstreams }}
{{- end }}
{{- $sessions := get $config "sessions" | default (dict) }}
{{- $_ := set $sessions "store" (ternary "redis" "memory" (eq (include "prefix-proxy.usesRedis" .) "true")) }}
{{- if eq .Values.sessionStore "redis-sentinel" }}
{{- $_ := set $sessions "redis_sentinels" .Values.redis.sentinels }}
{{- $_ := set $sessions "redis_sentinel_service" .Values.redis.sentinelService }}
{{- end }}
{{- if eq .Values.sessionStore "redis-cluster" }}
{{- $_ := set $sessions "redis_cluster" true }}
{{- end }}
{{- $_ := set $config "sessions" $sessions }}
{{- $_ := set $config "readiness" (dict "require_store" .Values.readiness.requireStore) }}
{{- toYaml $config }}
{{- end }}
