#!/bin/sh
# Prepare MinIO for reprolane; idempotent, run by the minio-init service of docker-compose.yml (minio/mc image).
#
# 1. the audit bucket, created WITH Object Lock (S3 cannot enable it later) and a COMPLIANCE default
#    retention, so not even the root user can delete an audit record before its retention ends;
# 2. a writer identity for the reprolane services (credentials from the s3_access_key / s3_secret_key secrets)
#    with a policy that can put, get and list, and cannot delete objects or change retention or the bucket.
# A bucket that already exists WITHOUT Object Lock is an error, never papered over (infra/buckets.py does the
# same for the local stack).
set -eu

read_secret() { tr -d '\r\n' < "/run/secrets/$1"; }

ROOT_USER=$(read_secret minio_root_user)
ROOT_PASSWORD=$(read_secret minio_root_password)
APP_KEY=$(read_secret s3_access_key)
APP_SECRET=$(read_secret s3_secret_key)
BUCKET=${S3_BUCKET:-reprolane-audit}
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

POLICY=/tmp/reprolane-writer.json
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
echo "minio-init: bucket $BUCKET (Object Lock, COMPLIANCE ${DAYS}d default), writer $APP_KEY ready"
