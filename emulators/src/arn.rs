//! IAM role ARNs and session names as AWS STS checks them
//! (`arn:PARTITION:iam::ACCOUNT:role/PATH/NAME`; session names of
//! `[\w+=,.@-]`), for the STS emulator.

/// Whether `c` may appear in a role session name (and a role name).
pub fn session_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '+' | '=' | ',' | '.' | '@' | '-')
}

/// A role ARN, split into the parts STS answers with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoleArn {
    partition: String,
    account: String,
    name: String,
}

impl RoleArn {
    /// `value` when it is a role ARN; `Err(())` otherwise (STS answers
    /// such a request with its own error, which the caller chooses).
    #[allow(clippy::result_unit_err)]
    pub fn parse(value: &str) -> Result<Self, ()> {
        let fields: Vec<&str> = value.splitn(6, ':').collect();
        let ["arn", partition, "iam", "", account, resource] = fields.as_slice() else {
            return Err(());
        };
        let path_and_name = resource.strip_prefix("role/").ok_or(())?;
        let name = path_and_name.rsplit('/').next().unwrap_or(path_and_name);
        let ok = partition.starts_with("aws")
            && account.len() == 12
            && account.bytes().all(|b| b.is_ascii_digit())
            && (1..=64).contains(&name.len())
            && name.chars().all(session_name_char);
        if !ok {
            return Err(());
        }
        Ok(RoleArn {
            partition: partition.to_string(),
            account: account.to_string(),
            name: name.to_string(),
        })
    }

    /// The partition: `aws`, `aws-cn`, `aws-us-gov`, …
    pub fn partition(&self) -> &str {
        &self.partition
    }

    /// The 12-digit account id.
    pub fn account(&self) -> &str {
        &self.account
    }

    /// The ARN of a session of this role:
    /// `arn:PARTITION:sts::ACCOUNT:assumed-role/NAME/SESSION`.
    pub fn assumed_role_arn(&self, session: &str) -> String {
        format!(
            "arn:{}:sts::{}:assumed-role/{}/{session}",
            self.partition, self.account, self.name
        )
    }
}

#[cfg(test)]
mod tests {
    use super::RoleArn;

    #[test]
    fn role_arns_split_and_others_are_refused() {
        let arn = RoleArn::parse("arn:aws:iam::111122223333:role/team/ray-data").unwrap();
        assert_eq!(arn.partition(), "aws");
        assert_eq!(arn.account(), "111122223333");
        assert_eq!(
            arn.assumed_role_arn("s1"),
            "arn:aws:sts::111122223333:assumed-role/ray-data/s1"
        );
        for bad in [
            "arn:aws:iam::1111:role/x",
            "arn:aws:iam::111122223333:user/x",
            "arn:aws:s3:::bucket",
            "arn:aws:iam::111122223333:role/",
            "role/x",
        ] {
            assert!(RoleArn::parse(bad).is_err(), "{bad}");
        }
    }
}
