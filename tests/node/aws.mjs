// @aws-sdk/credential-providers, unmodified, as an application in a pod
// would use them: the AWS_* variables alone choose and reach the surface.
//
//   node aws.mjs node-chain          fromNodeProviderChain() (the SDK clients' default)
//   node aws.mjs http                fromHttp(): the container endpoint
//   node aws.mjs instance-metadata   fromInstanceMetadata(): IMDSv2
//
// Not fromContainerMetadata(): that older provider (@smithy/credential-
// provider-imds) sends only AWS_CONTAINER_AUTHORIZATION_TOKEN, the secret in
// the variable itself, and ignores AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE.
// A pod gets only the _FILE variable (the token rotates, and a variable
// could not follow it), so fromContainerMetadata() would send no
// Authorization and be refused. fromHttp() is the provider that reads the
// file, and the one fromNodeProviderChain() tries first for a container URI.
import {
  fromHttp,
  fromInstanceMetadata,
  fromNodeProviderChain,
} from "@aws-sdk/credential-providers";
import { report } from "./report.mjs";

async function resolve(provider) {
  const creds = await provider();
  return {
    accessKeyId: creds.accessKeyId,
    secretAccessKey: creds.secretAccessKey,
    sessionToken: creds.sessionToken ?? null,
    expiration: creds.expiration ? creds.expiration.getTime() : null,
    // Which provider answered, as the SDK records it for its user agent
    // (CREDENTIALS_HTTP for the container endpoint, CREDENTIALS_IMDS for
    // instance metadata).
    features: Object.keys(creds.$source ?? {}),
    now: Date.now(),
  };
}

await report({
  "node-chain": () => resolve(fromNodeProviderChain()),
  http: () => resolve(fromHttp()),
  "instance-metadata": () => resolve(fromInstanceMetadata({ timeout: 5000, maxRetries: 1 })),
});
