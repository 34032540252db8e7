{{- define "rekindle.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "rekindle.fullname" -}}
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

{{- define "rekindle.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "rekindle.labels" -}}
helm.sh/chart: {{ include "rekindle.chart" . }}
{{ include "rekindle.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rekindle
{{- end }}

{{- define "rekindle.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rekindle.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "rekindle.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rekindle.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The namespaces the operator watches, as a JSON list: watchNamespaces, else the
release's own namespace; empty (all namespaces) only with rbac.clusterWide.
*/}}
{{- define "rekindle.watchNamespaces" -}}
{{- if .Values.rbac.clusterWide -}}
{{- toJson (list) -}}
{{- else if .Values.watchNamespaces -}}
{{- toJson .Values.watchNamespaces -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end }}

{{/*
An image reference from {repository, tag, digest} (dict "image" . "default" TAG):
repository@digest when a digest is set (it wins over the tag), else repository:tag.
*/}}
{{- define "rekindle.imageRef" -}}
{{- $img := .image -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository (default .default $img.tag) -}}
{{- end -}}
{{- end }}

{{/* The operator's image reference (tag default: the chart's appVersion). */}}
{{- define "rekindle.operatorImage" -}}
{{- include "rekindle.imageRef" (dict "image" .Values.image "default" .Chart.AppVersion) -}}
{{- end }}

{{/* The runtimeImages with a repository, as references, a JSON list (cpu, then gpu). */}}
{{- define "rekindle.runtimeImageRefs" -}}
{{- $refs := list -}}
{{- range $kind := list "cpu" "gpu" -}}
{{- $img := get $.Values.runtimeImages $kind -}}
{{- if and $img $img.repository -}}
{{- $refs = append $refs (include "rekindle.imageRef" (dict "image" $img "default" $.Chart.AppVersion)) -}}
{{- end -}}
{{- end -}}
{{- toJson $refs -}}
{{- end }}

{{/* The allow-list: runtimeImages, then allowedRuntimeImages, without repeats; a JSON list. */}}
{{- define "rekindle.allowedImageList" -}}
{{- $all := concat (include "rekindle.runtimeImageRefs" . | fromJsonArray) .Values.allowedRuntimeImages -}}
{{- toJson (uniq $all) -}}
{{- end }}

{{/* The runtime images InferenceServices may use, one per line. */}}
{{- define "rekindle.allowedImages" -}}
{{- join "\n" (include "rekindle.allowedImageList" . | fromJsonArray) -}}
{{- end }}

{{/* The namespaced permissions: exactly the objects the operator reads and writes. */}}
{{- define "rekindle.namespacedRules" -}}
# InferenceService and Checkpoint: watched; kopf patches metadata (finalizers,
# its progress annotations); the operator writes status and checkpoint owner refs.
- apiGroups: ["rekindle.dev"]
  resources: ["inferenceservices", "checkpoints"]
  verbs: ["get", "list", "watch", "patch"]
# Automatic checkpoints (spec.coldStart.checkpoint): created, and retired past `keep`.
- apiGroups: ["rekindle.dev"]
  resources: ["checkpoints"]
  verbs: ["create", "delete"]
- apiGroups: ["rekindle.dev"]
  resources: ["inferenceservices/status", "checkpoints/status"]
  verbs: ["patch"]
# Owned objects: server-side apply (patch; a create when the object is new) or
# create-once; read by name first (is it ours?).
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch"]
# ReplicaSets: read only, to trust only pods the service's own Deployment made.
- apiGroups: ["apps"]
  resources: ["replicasets"]
  verbs: ["list"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "create", "patch"]
# The agent token and signing key: created once, read to call the agent; the
# spec.adminTLS Secret: read by name for its ca.crt. Never listed.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "create"]
# Pods: pick one to checkpoint, take it out of the Service (label), mirror its boot path;
# watch new ones to release their scheduling gate toward the warm nodes (placement).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch"]
# Deleting a checkpoint's data (deletionPolicy Delete) runs a short Job.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "create"]
# Each InferenceService's NetworkPolicy (only the operator reaches the agent's admin port).
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch"]
# Each InferenceService's optional PodDisruptionBudget (spec.disruptionBudget).
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch", "delete"]
# Each InferenceService's optional KEDA ScaledObject (spec.autoscaling).
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "create", "patch", "delete"]
# kopf posts core v1 Events.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/*
The Secret holding the node agents' checkpoint signing key: the one named in
values, or the one the chart makes.
*/}}
{{- define "rekindle.nodeSigningKeySecret" -}}
{{- .Values.nodeAgent.signingKeySecret | default (printf "%s-node-signing-key" (include "rekindle.fullname" .)) -}}
{{- end }}

{{/* The front's labels (templates/front.yaml). */}}
{{- define "rekindle.frontSelectorLabels" -}}
app.kubernetes.io/name: {{ include "rekindle.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: front
{{- end }}

{{- define "rekindle.frontLabels" -}}
helm.sh/chart: {{ include "rekindle.chart" . }}
{{ include "rekindle.frontSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rekindle
{{- end }}

{{/* Where KEDA reaches the front: front.url, or its Service's cluster DNS name. */}}
{{- define "rekindle.frontURL" -}}
{{- if .Values.front.url -}}
{{- .Values.front.url -}}
{{- else -}}
{{- printf "http://%s-front.%s.svc:8080" (include "rekindle.fullname" .) .Release.Namespace -}}
{{- end -}}
{{- end }}
