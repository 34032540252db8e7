{{- define "keda.labels" -}}
app.kubernetes.io/part-of: keda-operator
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}

{{- define "keda.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
{{- end }}

{{/* KEDA's names are fixed: its certificates name these Services. */}}
{{- define "keda.operatorHost" -}}
{{ printf "keda-operator.%s.svc.%s" .Release.Namespace .Values.clusterDomain }}
{{- end }}
