//! The published hint vectors (written by the Python client's independent implementation)
//! against the Rust one that the agent and the XDP program use.

use balancer_common::hint::{fnv1a64, HintRange};

#[test]
fn published_vectors() {
    let text = include_str!("../hint-vectors.json");
    let data: serde_json::Value = serde_json::from_str(text).expect("vectors are JSON");
    assert_eq!(data["scheme"], "fnv1a64-mod-buckets-v1");
    let vectors = data["vectors"].as_array().expect("a list of vectors");
    assert!(vectors.len() >= 5);
    for v in vectors {
        let prefix = v["prefix"].as_str().unwrap();
        let num = |k: &str| v[k].as_u64().unwrap() as u16;
        let range = HintRange::new(num("start"), num("span"), num("buckets")).unwrap();
        assert_eq!(
            format!("{:016x}", fnv1a64(prefix.as_bytes())),
            v["fnv1a64"],
            "{prefix:?}"
        );
        let bucket = range.bucket_of_prefix(prefix.as_bytes());
        assert_eq!(bucket, num("bucket"), "{prefix:?}");
        let ports: Vec<u64> = range.ports(bucket).take(3).map(u64::from).collect();
        let expected: Vec<u64> = v["first_ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_u64().unwrap())
            .collect();
        assert_eq!(ports, expected, "{prefix:?}");
    }
}
