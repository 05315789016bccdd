"""Deployment assets for mtpserve: KubeRay manifests, a kustomize-compatible renderer, validators."""
