{{/* Chart name, truncated to 63 characters (a DNS label). */}}
{{- define "osd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Full name: release-chart, or the release name alone when it already holds the chart name;
63 characters at most since some name fields are DNS labels. Names derived from it add
suffixes, so it is cut to leave room for them.
*/}}
{{- define "osd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A resource name: the full name plus a suffix, still within 63 characters. */}}
{{- define "osd.component" -}}
{{- $suffix := index . 1 -}}
{{- printf "%s-%s" (include "osd.fullname" (index . 0) | trunc (int (sub 62 (len $suffix))) | trimSuffix "-") $suffix -}}
{{- end -}}

{{- define "osd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "osd.labels" -}}
helm.sh/chart: {{ include "osd.chart" . }}
{{ include "osd.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The labels selectors use: stable across upgrades. */}}
{{- define "osd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "osd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Every Ray pod (head and workers) carries these; NetworkPolicies and the PodMonitor select them. */}}
{{- define "osd.raySelectorLabels" -}}
{{ include "osd.selectorLabels" . }}
app.kubernetes.io/component: ray
{{- end -}}

{{- define "osd.redisSelectorLabels" -}}
{{ include "osd.selectorLabels" . }}
app.kubernetes.io/component: redis
{{- end -}}

{{- define "osd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "osd.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "osd.secretName" -}}
{{- default (include "osd.fullname" .) .Values.existingSecret -}}
{{- end -}}

{{- define "osd.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}

{{- define "osd.registryUri" -}}
{{- default (printf "file://%s/registry" .Values.stateDir) .Values.registry.uri -}}
{{- end -}}

{{/* Whether the Redis URL comes from the Secret (an external Redis) rather than the chart's. */}}
{{- define "osd.externalRedis" -}}
{{- if or .Values.externalRedis.url .Values.externalRedis.enabled }}true{{ end -}}
{{- end -}}

{{/* "true" where the chart's own Redis runs with one ACL user per role. */}}
{{- define "osd.redisAcl" -}}
{{- if and .Values.redis.enabled (not (include "osd.externalRedis" .)) .Values.redis.acl.enabled }}true{{ end -}}
{{- end -}}

{{/* The record stream's name (its ACL users' keys are it, its dead letters, its status hash). */}}
{{- define "osd.streamName" -}}
{{- (.Values.config.stream | default dict).stream | default "osd:records" -}}
{{- end -}}

{{/*
What each role's Redis user may run: the same rules as infra/redis/acl.py ROLE_COMMANDS
(tests/test_helm.py holds the two equal).
*/}}
{{- define "osd.redisAclCommands" -}}
producer: "+ping +xadd +xtrim +xlen +xinfo|groups +bgrewriteaof +multi +exec +get +set"
trainer: "+ping +xreadgroup +xread +xrange +xrevrange +xlen +xack +xautoclaim +xclaim +xpending +xgroup|create +xinfo +xadd +hset +hincrby +hgetall"
admin: "+ping +xrange +xrevrange +xlen +xinfo +xdel +xtrim +hgetall"
{{- end -}}

{{- define "osd.redisTlsDir" -}}/etc/osd-redis-tls{{- end -}}

{{/*
The platform config the ConfigMap holds: .Values.config with what the chart decides filled in,
so the file alone says where state, the registry and the trainers go.
*/}}
{{- define "osd.config" -}}
{{- $fixed := dict "state_dir" .Values.stateDir
      "registry" (dict "uri" (include "osd.registryUri" .))
      "train" (dict "resources" (dict .Values.workers.trainer.resourceName 1)) -}}
{{- if .Values.model.path }}
{{- $_ := set $fixed "model" (dict "target" .Values.model.path) -}}
{{- end }}
{{- toYaml (mustMergeOverwrite (deepCopy .Values.config) $fixed) -}}
{{- end -}}

{{/* The environment of every Ray container. */}}
{{- define "osd.rayEnv" -}}
- name: OSD_CONFIG
  value: /etc/osd/config.yaml
- name: OSD_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "osd.secretName" . }}
      key: {{ .Values.secretKeys.apiKey }}
# The tenants' keys (serve.api_keys); optional, so an existingSecret without them serves OSD_API_KEY alone.
- name: OSD_SERVE__API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ include "osd.secretName" . }}
      key: {{ .Values.secretKeys.tenantApiKeys }}
      optional: true
# Serve's HTTP proxy checks the keys too, so Serve's own routes (/-/routes) are covered.
- name: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
  value: serve.api.proxy_auth:middlewares
{{- if include "osd.redisAcl" . }}
# Each client connects as its role's ACL user, osd-<role> (stream.users; infra/records/streams.py connect).
{{- range $role := list "producer" "trainer" "admin" }}
- name: OSD_STREAM__USERS__{{ upper $role }}__PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "osd.secretName" $ }}
      key: {{ $.Values.secretKeys.redisAclPassword }}-{{ $role }}
{{- end }}
{{- end }}
{{- if include "osd.externalRedis" . }}
- name: OSD_STREAM__REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "osd.secretName" . }}
      key: {{ .Values.secretKeys.redisUrl }}
{{- else }}
# No OSD_ prefix: every OSD_* variable is read as a config path.
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "osd.secretName" . }}
      key: {{ .Values.secretKeys.redisPassword }}
{{- if .Values.redis.tls.enabled }}
- name: OSD_STREAM__REDIS_URL
  value: "rediss://:$(REDIS_PASSWORD)@{{ include "osd.component" (list . "redis") }}:6379/0?ssl_ca_certs={{ include "osd.redisTlsDir" . }}/ca.crt"
{{- else }}
- name: OSD_STREAM__REDIS_URL
  value: "redis://:$(REDIS_PASSWORD)@{{ include "osd.component" (list . "redis") }}:6379/0"
{{- end }}
{{- end }}
{{- end -}}

{{/*
One Ray container and the pod around it: (list $ group-values container-name extra-limits role),
role being head, serving or trainer (the PodDisruptionBudget selects the serving pods by it).
Every Ray pod mounts the config and the state volume and carries the same environment, so a
replica, a trainer or the loop supervisor runs the same on any of them.
*/}}
{{- define "osd.rayPod" -}}
{{- $ := index . 0 -}}
{{- $group := index . 1 -}}
{{- $container := index . 2 -}}
{{- $limits := index . 3 -}}
metadata:
  labels:
    {{- include "osd.raySelectorLabels" $ | nindent 4 }}
    osd-platform/role: {{ index . 4 }}
  annotations:
    # A new config is a new cluster (rayClusterConfig changed): the pods read the file at start.
    checksum/config: {{ include "osd.config" $ | sha256sum }}
spec:
  serviceAccountName: {{ include "osd.serviceAccountName" $ }}
  {{- with $.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ $container }}
      image: {{ include "osd.image" $ }}
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      env:
        {{- include "osd.rayEnv" $ | nindent 8 }}
      {{- if $.Values.registry.credentialsSecret }}
      envFrom:
        - secretRef:
            name: {{ $.Values.registry.credentialsSecret }}
      {{- end }}
      ports:
        - {name: gcs, containerPort: 6379}
        - {name: dashboard, containerPort: 8265}
        - {name: client, containerPort: 10001}
        - {name: serve, containerPort: 8000}
        - {name: metrics, containerPort: 8080}
      resources:
        requests:
          {{- toYaml $group.resources.requests | nindent 10 }}
        limits:
          {{- toYaml (merge (deepCopy $limits) $group.resources.limits) | nindent 10 }}
      volumeMounts:
        - {name: config, mountPath: /etc/osd, readOnly: true}
        - {name: state, mountPath: {{ $.Values.stateDir }}}
        {{- if and $.Values.redis.tls.enabled (not (include "osd.externalRedis" $)) }}
        - {name: redis-tls, mountPath: {{ include "osd.redisTlsDir" $ }}, readOnly: true}
        {{- end }}
        {{- if $.Values.model.volume }}
        - {name: model, mountPath: {{ $.Values.model.mountPath }}, readOnly: true}
        {{- end }}
  volumes:
    {{- if and $.Values.redis.tls.enabled (not (include "osd.externalRedis" $)) }}
    - name: redis-tls
      secret:
        secretName: {{ $.Values.redis.tls.secretName }}
        items: [{key: ca.crt, path: ca.crt}]
    {{- end }}
    - name: config
      configMap:
        name: {{ include "osd.component" (list $ "config") }}
    - name: state
      {{- if $.Values.registry.persistence.enabled }}
      persistentVolumeClaim:
        claimName: {{ default (include "osd.component" (list $ "state")) $.Values.registry.persistence.existingClaim }}
      {{- else }}
      emptyDir: {}
      {{- end }}
    {{- with $.Values.model.volume }}
    - name: model
      {{- toYaml . | nindent 6 }}
    {{- end }}
  {{- with $group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
