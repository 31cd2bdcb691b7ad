use md5::{Digest as _, Md5};

use super::*;

#[test]
fn locations() {
    let l = S3Location::parse("s3://ckpt-bucket/a/b/").expect("valid");
    assert_eq!(l.bucket, "ckpt-bucket");
    assert_eq!(l.prefix, "a/b");
    assert_eq!(l.key("job-1/LATEST"), "a/b/job-1/LATEST");
    let l = S3Location::parse("s3://bkt").expect("valid");
    assert_eq!(l.prefix, "");
    assert_eq!(l.key("x"), "x");
    for bad in [
        "http://b/x",
        "s3://",
        "s3://ab",
        "s3://Bad/x",
        "s3://bkt/a//b",
        "s3://bkt/../x",
    ] {
        assert!(S3Location::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn settings_validation() {
    S3Settings::default()
        .validate()
        .expect("defaults are valid");
    let bad = S3Settings {
        part_size_bytes: 1024,
        ..S3Settings::default()
    };
    assert!(bad.validate().is_err());
    let bad = S3Settings {
        access_key_id: Some("k".into()),
        ..S3Settings::default()
    };
    assert!(bad.validate().is_err());
    let bad = S3Settings {
        endpoint_url: Some("127.0.0.1:9000".into()),
        ..S3Settings::default()
    };
    assert!(bad.validate().is_err());
}

#[test]
fn etags() {
    let md5 = Md5::digest(b"abc");
    assert!(check_etag(Some("\"900150983cd24fb0d6963f7d28e17f72\""), &md5).is_ok());
    assert!(check_etag(Some("\"00\""), &md5).is_err());
    assert!(check_etag(None, &md5).is_err());
}
