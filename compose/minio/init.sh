#!/bin/sh
# Prepare MinIO for kvstore: the bucket $S3_BUCKET, and a user $S3_ACCESS_KEY_ID with the
# readwrite policy, so kvstore never holds the root credentials. Every step is idempotent.
set -eu

mc alias set local "$MINIO_URL" "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD" >/dev/null
mc mb --ignore-existing "local/$S3_BUCKET"
mc admin user add local "$S3_ACCESS_KEY_ID" "$S3_SECRET_ACCESS_KEY" >/dev/null
# (plain sh, no grep: the mc image is minimal)
case "$(mc admin user info local "$S3_ACCESS_KEY_ID")" in
  *readwrite*) ;;
  *) mc admin policy attach local readwrite --user "$S3_ACCESS_KEY_ID" ;;
esac
echo "bucket $S3_BUCKET ready for $S3_ACCESS_KEY_ID"
