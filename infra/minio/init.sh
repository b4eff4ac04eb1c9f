#!/bin/sh
# Prepare MinIO for reprolane; idempotent, run by the minio-init service of docker-compose.yml (minio/mc image).
#
# 1. the audit bucket, created WITH Object Lock (S3 cannot enable it later) and a COMPLIANCE default
#    retention, so not even the root user can delete an audit record before its retention ends;
# 2. a writer identity for the reprolane services (credentials from the s3_access_key / s3_secret_key secrets)
#    with a policy that can put, get and list, and cannot delete objects or change retention or the bucket;
# 3. one policy per operator role (reprolane-viewer, -hold-admin, -retention-admin, -key-admin; see
#    docs/SECURITY.md "Operators"): created, not attached. An operator's S3 identity gets the policy of its role
#    (`mc admin policy attach local reprolane-hold-admin --user ALICE`), so that S3 refuses what reprolane's own
#    operator-key check would refuse, even to a CLI that skipped it.
# A bucket that already exists WITHOUT Object Lock is an error, never papered over (infra/stack/buckets.py does the
# same for the local stack).
set -eu

SECRETS=${SECRETS_DIR:-/run/secrets}
read_secret() { tr -d '\r\n' < "$SECRETS/$1"; }

ROOT_USER=$(read_secret minio_root_user)
ROOT_PASSWORD=$(read_secret minio_root_password)
APP_KEY=$(read_secret s3_access_key)
APP_SECRET=$(read_secret s3_secret_key)
BUCKET=${S3_BUCKET:-reprolane-audit}
KEYS_BUCKET=${KEYS_BUCKET:-reprolane-lake}
DAYS=${AUDIT_RETENTION_DAYS:-1}

mc alias set local "${MINIO_URL:-http://minio:9000}" "$ROOT_USER" "$ROOT_PASSWORD" > /dev/null

if ! mc stat "local/$BUCKET" > /dev/null 2>&1; then
    mc mb --with-lock "local/$BUCKET"
fi
if ! mc retention info --default "local/$BUCKET" 2>/dev/null | grep -qi compliance; then
    if ! mc retention set --default COMPLIANCE "${DAYS}d" "local/$BUCKET"; then
        echo "minio-init: cannot set a default retention on $BUCKET (created without Object Lock?); refusing" >&2
        exit 2
    fi
fi

# Policy files in a directory of this run's own: a fixed /tmp name is another run's to overwrite (or a symlink
# planted there) while mc reads it.
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
POLICY=$WORK/reprolane-writer.json
cat > "$POLICY" <<JSON
{
  "Version": "2012-10-17",
  "Statement": [
    {"Effect": "Allow", "Action": ["s3:GetBucketLocation", "s3:ListBucket", "s3:GetBucketObjectLockConfiguration"],
     "Resource": ["arn:aws:s3:::$BUCKET"]},
    {"Effect": "Allow", "Action": ["s3:PutObject", "s3:GetObject", "s3:PutObjectRetention", "s3:GetObjectRetention",
                                   "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"],
     "Resource": ["arn:aws:s3:::$BUCKET/*"]}
  ]
}
JSON
mc admin policy create local reprolane-writer "$POLICY" > /dev/null
mc admin user add local "$APP_KEY" "$APP_SECRET" > /dev/null
# attach fails when the policy is already attached: that is the idempotent case, so check instead of failing.
if ! mc admin user info local "$APP_KEY" | grep -q reprolane-writer; then
    mc admin policy attach local reprolane-writer --user "$APP_KEY" > /dev/null
fi
# Operator roles. Every role reads the audit bucket and writes its decisions under audit/access/ (write-once).
READ_AUDIT='{"Effect": "Allow", "Action": ["s3:GetBucketLocation", "s3:ListBucket"], "Resource": ["arn:aws:s3:::'$BUCKET'"]},
    {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": ["arn:aws:s3:::'$BUCKET'/*"]},
    {"Effect": "Allow", "Action": ["s3:PutObject"], "Resource": ["arn:aws:s3:::'$BUCKET'/audit/access/*"]}'
operator_policy() {  # NAME EXTRA_STATEMENTS
    file="$WORK/reprolane-$1.json"
    printf '{"Version": "2012-10-17", "Statement": [\n    %s%s\n]}\n' "$READ_AUDIT" "$2" > "$file"
    mc admin policy create local "reprolane-$1" "$file" > /dev/null
}
operator_policy viewer ""
operator_policy hold-admin ',
    {"Effect": "Allow", "Action": ["s3:GetObjectLegalHold", "s3:PutObjectLegalHold"],
     "Resource": ["arn:aws:s3:::'$BUCKET'/envelopes/*"]}'
operator_policy retention-admin ',
    {"Effect": "Allow", "Action": ["s3:ListBucketVersions"], "Resource": ["arn:aws:s3:::'$BUCKET'"]},
    {"Effect": "Allow", "Action": ["s3:GetObjectVersion", "s3:GetObjectLegalHold", "s3:GetObjectRetention",
                                   "s3:DeleteObjectVersion"], "Resource": ["arn:aws:s3:::'$BUCKET'/envelopes/*"]},
    {"Effect": "Allow", "Action": ["s3:PutObject", "s3:PutObjectRetention"],
     "Resource": ["arn:aws:s3:::'$BUCKET'/audit/expiry/*", "arn:aws:s3:::'$BUCKET'/index/*"]},
    {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": ["arn:aws:s3:::'$KEYS_BUCKET'"]},
    {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": ["arn:aws:s3:::'$KEYS_BUCKET'/lake/*"]}'
operator_policy key-admin ',
    {"Effect": "Allow", "Action": ["s3:ListBucket", "s3:ListBucketVersions"], "Resource": ["arn:aws:s3:::'$KEYS_BUCKET'"]},
    {"Effect": "Allow", "Action": ["s3:DeleteObject", "s3:DeleteObjectVersion"],
     "Resource": ["arn:aws:s3:::'$KEYS_BUCKET'/keys/*"]}'

echo "minio-init: bucket $BUCKET (Object Lock, COMPLIANCE ${DAYS}d default), writer $APP_KEY and the operator role policies ready"
