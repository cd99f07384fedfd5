//! One error of every variant (and so of every class) of
//! [`BrokerError`], for the tests that walk them through the wire format
//! and every surface. The errors themselves are `lanyard_core::grant`'s.

use std::time::Duration;

use crate::broker::BrokerError;
use crate::cloud::{Cloud, CloudError};
use crate::token::VerifyError;

/// One error of every variant (and so of every class), for the tests that
/// walk them through the wire format and every surface.
pub(crate) fn samples() -> Vec<BrokerError> {
    vec![
        BrokerError::NotBound {
            cloud: Cloud::Aws,
            namespace: "ml".into(),
            name: "ray".into(),
        },
        BrokerError::IdentityNotFound,
        BrokerError::CloudDisabled(Cloud::Gcp),
        BrokerError::BadRequest("resource is empty".into()),
        BrokerError::Unauthenticated(VerifyError::Expired),
        BrokerError::Unauthenticated(VerifyError::Keys(crate::token::KeysError::Fetch {
            url: "http://issuer/jwks".into(),
            reason: "down".into(),
        })),
        BrokerError::Denied {
            reason: "no control-plane scopes".into(),
            policies: vec!["no-management".into()],
        },
        BrokerError::Upstream(CloudError::Rejected {
            cloud: Cloud::Azure,
            code: "AADSTS70021".into(),
            message: "No matching federated identity record found".into(),
        }),
        BrokerError::Upstream(CloudError::CallerLimited {
            cloud: Cloud::Azure,
            limit: crate::cloud::CallerLimit::NewKeys,
            retry_after: Duration::from_secs(2),
        }),
        BrokerError::Upstream(CloudError::Throttled {
            cloud: Cloud::Aws,
            code: "Throttling".into(),
            retry_after: Some(Duration::from_secs(7)),
        }),
        BrokerError::Upstream(CloudError::Unavailable {
            cloud: Cloud::Gcp,
            reason: "connection reset".into(),
        }),
        BrokerError::Upstream(CloudError::Protocol {
            cloud: Cloud::Azure,
            reason: "not JSON".into(),
        }),
        BrokerError::Unavailable("node agent unreachable".into()),
    ]
}
