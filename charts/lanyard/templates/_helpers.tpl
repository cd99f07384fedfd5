{{/* Names, labels and the configuration shared by the agent and webhook. */}}

{{- define "lanyard.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "lanyard.agent" -}}{{ include "lanyard.fullname" . }}-agent{{- end -}}
{{- define "lanyard.webhook" -}}{{ include "lanyard.fullname" . }}-webhook{{- end -}}

{{- define "lanyard.labels" -}}
app.kubernetes.io/name: lanyard
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: lanyard
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "lanyard.selector" -}}
app.kubernetes.io/name: lanyard
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "lanyard.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* How a sidecar reaches the agent on its node. */}}
{{- define "lanyard.agentUrl" -}}
{{- if eq .Values.agent.reachVia "hostPort" -}}
http://$(LANYARD_HOST_IP):{{ .Values.agent.port }}
{{- else -}}
http://{{ include "lanyard.agent" . }}.{{ .Release.Namespace }}.svc:{{ .Values.agent.port }}
{{- end -}}
{{- end -}}

{{/* Restricted Pod Security, for every container Lanyard runs. */}}
{{- define "lanyard.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "lanyard.podSecurity" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/*
The Lanyard configuration file (docs/configuration.md) of one role
(`include "lanyard.config" (dict "root" . "role" "agent")`), from the same
values for both, so that the audiences the webhook mounts are the ones the
agent expects. Each role's file holds only the sections it reads, so that
every path in it is one its pod mounts. Keys left empty in the values stay
at Lanyard's defaults.
*/}}
{{- define "lanyard.config" -}}
{{- $role := .role -}}
{{- with .root -}}
{{- $v := .Values -}}
{{- $azure := dict "cloud" $v.azure.cloud "audience" $v.azure.audience -}}
{{- with $v.azure.tenantId }}{{ $_ := set $azure "tenant_id" . }}{{ end -}}
{{- with $v.azure.authorityHost }}{{ $_ := set $azure "authority_host" . }}{{ end -}}
{{- with $v.azure.nodeIdentities }}{{ $_ := set $azure "node_identities" . }}{{ end -}}
{{- $binding := $v.azure.identityBinding | default dict -}}
{{- with $binding.sniName }}{{ $_ := set $azure "identity_binding_sni" . }}{{ $_ := set $azure "audience" "api://AKSIdentityBinding" }}{{ end -}}
{{- with $binding.proxy }}{{ $_ := set $azure "identity_binding_proxy" . }}{{ end -}}
{{- $gcp := dict "token_lifetime" $v.gcp.tokenLifetime -}}
{{- with $v.gcp.workloadIdentityProvider }}{{ $_ := set $gcp "workload_identity_provider" . }}{{ end -}}
{{- with $v.gcp.projectId }}{{ $_ := set $gcp "project_id" . }}{{ end -}}
{{- with $v.gcp.projectNumber }}{{ $_ := set $gcp "project_number" (toString .) }}{{ end -}}
{{- with $v.gcp.audience }}{{ $_ := set $gcp "audience" . }}{{ end -}}
{{- with $v.gcp.gkeCluster }}{{ $_ := set $gcp "gke_cluster" . }}{{ end -}}
{{- with $v.gcp.universeDomain }}{{ $_ := set $gcp "universe_domain" . }}{{ end -}}
{{- $aws := dict "region" $v.aws.region "audience" $v.aws.audience "session_duration" $v.aws.sessionDuration -}}
{{- with $v.aws.stsEndpoint }}{{ $_ := set $aws "sts_endpoint" . }}{{ end -}}
{{- with $v.aws.clusterArn }}{{ $_ := set $aws "cluster_arn" . }}{{ end -}}
{{- $cluster := dict "token_review" $v.cluster.tokenReview -}}
{{- with $v.cluster.issuer }}{{ $_ := set $cluster "issuer" . }}{{ end -}}
{{- $audit := dict "on_failure" $v.audit.onFailure "stdout" $v.audit.stdout "export_max_backlog" $v.audit.exportMaxBacklog "export_when_full" $v.audit.exportWhenFull -}}
{{- with $v.cluster.name }}{{ $_ := set $audit "cluster" . }}{{ end -}}
{{- if $v.audit.file.enabled -}}
{{- $_ := set $audit "file" "/var/lib/lanyard/audit/audit.jsonl" -}}
{{- $_ := set $audit "file_max_bytes" $v.audit.file.maxBytes -}}
{{- $_ := set $audit "file_max_age_seconds" $v.audit.file.maxAgeSeconds -}}
{{- $_ := set $audit "file_keep" $v.audit.file.keep -}}
{{- $_ := set $audit "fsync" $v.audit.file.fsync -}}
{{- end -}}
{{- with $v.audit.syslog.url }}{{ $_ := set $audit "syslog" . }}{{ end -}}
{{- if $v.audit.syslog.caPem }}{{ $_ := set $audit "syslog_ca" "/etc/lanyard/audit-ca/ca.pem" }}{{ end -}}
{{- with $v.audit.http.url }}{{ $_ := set $audit "http" . }}{{ end -}}
{{- if $v.audit.http.tokenSecret }}{{ $_ := set $audit "http_token_file" "/etc/lanyard/audit-token/token" }}{{ end -}}
{{- $policy := dict "reload_seconds" $v.policy.reloadSeconds -}}
{{- if $v.policy.enabled }}{{ $_ := set $policy "dir" "/etc/lanyard/policies" }}{{ end -}}
{{- $r := $v.sidecar.resources -}}
{{- $webhook := dict "sidecar_image" (include "lanyard.image" .) "agent_url" (include "lanyard.agentUrl" .) "sidecar_port" $v.sidecar.port "probe_port" $v.sidecar.probePort "sidecar_cpu_request" $r.cpuRequest "sidecar_memory_request" $r.memoryRequest "sidecar_cpu_limit" $r.cpuLimit "sidecar_memory_limit" $r.memoryLimit "tls_cert" "/etc/lanyard/tls/tls.crt" "tls_key" "/etc/lanyard/tls/tls.key" -}}
{{- with $v.image.pullPolicy }}{{ $_ := set $webhook "image_pull_policy" . }}{{ end -}}
{{- with $v.guard.extraAudiences }}{{ $_ := set $webhook "guard_extra_audiences" . }}{{ end -}}
{{- $cache := dict "max_entries" $v.cache.maxEntries "upstream_concurrency" $v.cache.upstreamConcurrency -}}
{{- $config := dict "azure" $azure "gcp" $gcp "aws" $aws "audit" $audit -}}
{{- if eq $role "agent" -}}
{{- $_ := set $config "shutdown_delay_seconds" $v.agent.shutdownDelaySeconds -}}
{{- $_ := set $config "cluster" $cluster -}}
{{- $_ := set $config "policy" $policy -}}
{{- $_ := set $config "cache" $cache -}}
{{- else -}}
{{- $_ := set $config "shutdown_delay_seconds" $v.webhook.shutdownDelaySeconds -}}
{{- $_ := set $config "webhook" $webhook -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}
{{- end -}}

{{/*
Static-analysis (checkov) findings that do not apply, each with its reason;
tests/python/test_chart.py fails on any other finding.
*/}}
{{- define "lanyard.checkovSkips" -}}
checkov.io/skip1: CKV_K8S_11=No CPU limit by design - CFS throttling would stall the credential path of every pod on the node during a herd; CPU requests are set
checkov.io/skip2: CKV_K8S_43=Pinned with image.digest; the chart cannot know the digest of the image pushed to the user's registry, so the default is the release tag
checkov.io/skip3: CKV_K8S_38=Both roles call the Kubernetes API (ServiceAccount and Pod watches, issuer keys), which needs the ServiceAccount token
checkov.io/skip4: CKV_K8S_15=IfNotPresent with immutable release tags (or image.digest); image.pullPolicy sets Always where wanted
{{- end -}}

{{/*
The guard's cloud audiences, ASCII-lowercased, as a JSON (and CEL) list:
what lanyard webhook's Guard::new computes from the same configuration.
*/}}
{{- define "lanyard.guardAudiences" -}}
{{- $v := .Values -}}
{{- $list := list "api://AzureADTokenExchange" "api://AzureADTokenExchangeUSGov" "api://AzureADTokenExchangeChina" "api://AzureADTokenExchangeUSNat" "api://AzureADTokenExchangeUSSec" "api://AKSIdentityBinding" $v.azure.audience $v.aws.audience -}}
{{- if $v.gcp.workloadIdentityProvider -}}
{{- $google := $v.gcp.audience | default $v.gcp.workloadIdentityProvider -}}
{{- $list = append $list $google -}}
{{- if hasPrefix "//" $google }}{{ $list = append $list (printf "https:%s" $google) }}{{ end -}}
{{- if hasPrefix "https://" $google }}{{ $list = append $list (trimPrefix "https:" $google) }}{{ end -}}
{{- else if $v.gcp.gkeCluster -}}
{{- $list = append $list ($v.gcp.audience | default (printf "%s.svc.id.goog" (index (splitList "/" $v.gcp.gkeCluster) 1))) -}}
{{- end -}}
{{- range $v.guard.extraAudiences }}{{ $list = append $list . }}{{ end -}}
{{- $lower := list -}}
{{- range $list }}{{ $a := . | trim | lower }}{{ if $a }}{{ $lower = append $lower $a }}{{ end }}{{ end -}}
{{- $lower | uniq | sortAlpha | toJson -}}
{{- end -}}

{{/*
The node agent's host name as a pod would resolve it, lowercased; empty
when sidecars reach the agent at the node's IP.
*/}}
{{- define "lanyard.agentHost" -}}
{{- if ne .Values.agent.reachVia "hostPort" -}}
{{- printf "%s.%s.svc" (include "lanyard.agent" .) .Release.Namespace | lower -}}
{{- end -}}
{{- end -}}

{{/*
CEL: whether container `c` is Lanyard's sidecar, field for field as the
webhook's SidecarShape::matches decides it.
*/}}
{{- define "lanyard.guardSidecar" -}}
{{- $v := .Values -}}
{{- $env := dict "LANYARD_AGENT_URL" (include "lanyard.agentUrl" .) "LANYARD_TOKEN_DIR" "/var/run/lanyard/tokens" "LANYARD_APP_TOKEN_FILE" "/var/run/lanyard/app/app" "LANYARD_AWS_REGION" $v.aws.region -}}
{{- $args := list "--listen" (printf "127.0.0.1:%v" $v.sidecar.port) "--probe-listen" (printf "0.0.0.0:%v" $v.sidecar.probePort) -}}
(c.name == 'lanyard' && has(c.restartPolicy) && c.restartPolicy == 'Always'
  && has(c.image) && c.image == {{ include "lanyard.image" . | toJson }}
  && has(c.command) && c.command == ["lanyard-sidecar"]
  && (has(c.args) ? c.args : []) == {{ $args | toJson }}
  && (!has(c.envFrom) || size(c.envFrom) == 0)
  && (!has(c.env) || c.env.all(e,
       e.name == 'LANYARD_HOST_IP'
         ? (has(e.valueFrom) && has(e.valueFrom.fieldRef) && e.valueFrom.fieldRef.fieldPath == 'status.hostIP')
         : (e.name == 'IDENTITY_HEADER'
           ? !has(e.valueFrom)
           : (!has(e.valueFrom) && has(e.value) && e.name in {{ $env | toJson }} && e.value == {{ $env | toJson }}[e.name]))))
  && (!has(c.volumeMounts) || c.volumeMounts.all(m,
       (m.name == 'lanyard-tokens' && m.mountPath == '/var/run/lanyard/tokens')
       || (m.name == 'lanyard-app-token' && m.mountPath == '/var/run/lanyard/app')
       || (m.name == 'lanyard-no-api-token' && m.mountPath == '/var/run/secrets/kubernetes.io/serviceaccount')))
  && (!has(c.lifecycle) || (!has(c.lifecycle.preStop) && has(c.lifecycle.postStart)
       && has(c.lifecycle.postStart.exec) && has(c.lifecycle.postStart.exec.command)
       && c.lifecycle.postStart.exec.command == {{ list "lanyard-sidecar" "wait-ready" "--port" (printf "%v" $v.sidecar.probePort) "--timeout" "120" | toJson }}
       && !has(c.lifecycle.postStart.httpGet) && !has(c.lifecycle.postStart.sleep) && !has(c.lifecycle.postStart.tcpSocket)))
  && !(has(c.startupProbe) && has(c.startupProbe.exec))
  && !(has(c.livenessProbe) && has(c.livenessProbe.exec))
  && !(has(c.readinessProbe) && has(c.readinessProbe.exec)))
{{- end -}}

{{/* Whether container c holds CAP_SYS_PTRACE (privileged, or the capability
or ALL added; containerd and CRI-O upper-case the names and add CAP_), as
src/webhook/guard.rs's ptrace_power decides. */}}
{{- define "lanyard.guardTracer" -}}
(has(c.securityContext) && ((has(c.securityContext.privileged) && c.securityContext.privileged)
  || (has(c.securityContext.capabilities) && has(c.securityContext.capabilities.add)
    && c.securityContext.capabilities.add.exists(k, k.upperAscii() in ['SYS_PTRACE', 'CAP_SYS_PTRACE', 'ALL', 'CAP_ALL']))))
{{- end -}}

{{/* The namespaces the guard governs. */}}
{{- define "lanyard.guardNamespaces" -}}
matchLabels:
  {{ .Values.guard.namespaceLabel }}: {{ .Values.guard.namespaceLabelValue | quote }}
matchExpressions:
  - key: kubernetes.io/metadata.name
    operator: NotIn
    values: [kube-system, {{ .Release.Namespace }}]
{{- end -}}
