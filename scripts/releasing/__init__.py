"""What `scripts/release` is made of: an OCI registry client (`oci`),
cosign's signature and attestation formats (`cosign`), the in-toto
statements a release attests (`statements`), and the chart as released
(`chart`). docs/release.md says what a release publishes and how to
verify it."""
